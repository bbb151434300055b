"""Scheduling: which endpoint serves an admitted request (profiles, plugins, their config)."""
