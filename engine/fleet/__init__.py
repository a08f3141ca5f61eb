"""The processes a KVFleet fleet runs beside its engines, started the same way by the demo, the benchmarks and
the tests: the sglang-router command line (:mod:`engine.fleet.router`) and a real ``mooncake_master``
(:mod:`engine.fleet.mooncake_master`)."""
