"""Audit: append-only records of every change (actor, request id, before/after, diff, reason, outcome)."""
