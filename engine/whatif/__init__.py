"""What-if replay of request traces through the cache tiers (``python -m engine.whatif``)."""
