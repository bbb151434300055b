"""Scorers, one module each; `registry.SCORERS` names them for the config."""
