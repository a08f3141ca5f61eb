"""The KVFleet engine agent: runs on each GPU host, launches and supervises its engine workers, and reports
them to the control plane (register, heartbeat, metrics). Modules: spec (fleet TOML), host (facts),
supervisor (processes, backoff), reporter (control-plane API, buffering), probe (worker HTTP), agent (run
loop), cli."""
