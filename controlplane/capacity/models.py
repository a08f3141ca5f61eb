"""Capacity keeps no tables yet: the sizing calculator is arithmetic over its inputs (services.py)."""
