"""Placeholder module so the entry point imports while the scheme is being written."""
