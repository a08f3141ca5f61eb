"""Operator console: Django templates + plain static JS (no Node build), talking to /api/v1 and /ws/v1."""
