"""The processes a KVFleet fleet runs beside its engines, started the same way by the demo, the benchmarks and
the tests: the router command line (:mod:`engine.fleet.router`: smg, or sglang-router 0.3.2 from its own
venv), which router answers at a URL and where it carries ``cache_salt`` (:mod:`engine.fleet.identity`), and a
real ``mooncake_master`` (:mod:`engine.fleet.mooncake_master`)."""
