"""Test support shared across test folders (not imported by the product)."""
