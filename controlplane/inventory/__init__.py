"""Inventory: hosts and their GPUs, engine workers, routers, L3 storage profiles."""
