"""Shared kernel: request context, errors, pagination, field encryption (no models)."""
