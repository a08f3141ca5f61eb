"""Telemetry has no admin: it has no tables."""
