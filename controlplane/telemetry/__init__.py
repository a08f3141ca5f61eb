"""Telemetry: metric ingest and scrape into Redis, throttled websocket broadcast per fleet and per worker."""
