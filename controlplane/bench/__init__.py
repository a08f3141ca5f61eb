"""Engine-free control-plane benchmarks (scripts, not tests)."""
