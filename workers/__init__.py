"""kvyard's workers: its own inference engine and OpenAI-compatible server.

Never imports the EPP. Shares only `kvyard.common` with other components.
"""
