"""Telemetry keeps no tables: samples live in Redis (see store.py)."""
