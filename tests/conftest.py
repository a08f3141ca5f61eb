"""Suite-wide pytest configuration (area fixtures live in tests/<area>/conftest.py)."""
