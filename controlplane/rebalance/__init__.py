"""Rebalance: guided rollout of a router's prefill:decode ratio, one worker role switch per step (Celery)."""
