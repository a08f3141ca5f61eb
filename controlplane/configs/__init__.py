"""Configs: HiCache config profiles with immutable numbered revisions and If-Match/ETag commits."""
