"""``kvfleet-agent run``: supervise this host's engine workers and keep the control plane informed.

The main thread supervises (starts, health-checks, restarts) and writes the state file that ``status``
reads; a reporter thread registers the host and its running workers, heartbeats, and ships every
``trace_interval_s`` seconds the new rows of each ``--record-trace`` worker's ``/recorded_trace`` (a cursor
per worker moves only once the control plane stored them; rows it rejects are logged and skipped). Metrics
are not sent: the fleet's TSDB scrapes each worker's ``/metrics`` itself, its targets from the control
plane's inventory (the workers this agent registers). SIGINT/SIGTERM stop every worker and exit.

Roles: each worker is registered, and listed in every heartbeat, with the role it reports running
(``/server_info`` ``disaggregation_mode``; the spec's role while it does not answer). A heartbeat answer's
``restart`` entries ({worker_url, role, seq}: the control plane's ``desired_role``, for engines that cannot
switch in place) make the main thread restart that worker with its flags rebuilt for the role
(:func:`engine.agent.spec.with_role`); the new role holds for later crash restarts until the agent itself
restarts (then the spec file's role applies again). Flags a restart-with-flags request changed outlast the
agent: they are kept in ``<log_dir>/agent-flags.json`` and applied at the next start while the spec file's
flags for that worker are unchanged (:mod:`engine.agent.flag_overrides`). A worker that switched role in place
(``/pd_role_switch``) is adopted the same way without a restart: its crash restarts keep the new role.

Acknowledgements (``role_acks`` in every heartbeat, per worker): ``applied`` is the newest request ``seq``
carried out (restarted in that role, or found running it), ``seen`` the newest ``request_seq`` of an answer
the main thread has fully processed. Answers are processed in the order they came, a restart before the
``seen`` of its answer moves, so once ``seen`` reaches the generation of a withdrawal the agent will not
restart the worker for any older request: the control plane knows which process it talks to.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import threading
import time

from engine.agent.engines import KVFLEET, launch_command
from engine.agent.flag_overrides import FlagOverrides
from engine.agent.host import host_facts
from engine.agent.probe import capabilities, recorded_trace, server_info, storage_backend
from engine.agent.reporter import ControlPlaneClient, ControlPlaneDown, ControlPlaneRejected, Reporter
from engine.agent.spec import (
    ENCODER,
    ROLE_OF_MODE,
    FleetSpec,
    WorkerSpec,
    flag_table,
    with_flags,
    with_role,
)
from engine.agent.supervisor import Managed, Supervisor
from engine.server.contract import reported_hicache_config

log = logging.getLogger("kvfleet.agent")
TICK_S = 0.5
TRACE_BATCH = 5000  # rows per push (the control plane takes up to 10,000)


def local_url(w: WorkerSpec) -> str:
    """Where this host reaches the worker's HTTP routes (its bind address, loopback for a wildcard bind; the
    HTTP sidecar's port for a --grpc-mode worker)."""
    host = "127.0.0.1" if w.host in ("0.0.0.0", "::", "") else w.host
    return f"http://{host}:{w.http_port or w.port}"


def command(w: WorkerSpec) -> list[str]:
    """The worker's argv: KVFleet's engine from this interpreter, or upstream SGLang from its spec's python
    (:func:`engine.agent.engines.launch_command`)."""
    return launch_command(w.engine, w.flags, w.python, w.env)


def managed(spec: FleetSpec) -> list[Managed]:
    """One supervised process per worker: ready when ``/health`` answers 200. Once running, a KVFleet worker
    is probed on ``/health`` again (it never blocks on the scheduler); an upstream SGLang worker on
    ``/model_info``, its HTTP server alone: upstream's ``/health`` runs a one-token generation that waits
    behind a busy scheduler (a 20 s CPU prefill failed three 2 s probes in a row and got a healthy worker
    restarted), and upstream ends its own process tree when a scheduler dies or its watchdog fires."""
    return [
        Managed(
            name=w.name,
            command=command(w),
            health_url=f"{local_url(w)}/health",
            log_path=os.path.join(spec.log_dir, f"worker-{w.name}.log"),
            env=w.env,
            live_url=f"{local_url(w)}/model_info" if w.engine != KVFLEET else None,
        )
        for w in spec.workers
    ]


def storage_fields(info: dict | None) -> dict:
    """The L3 backend a worker reports in ``/server_info`` as register fields: ``storage_backend`` ("" when
    none is attached) and ``storage_extra_config`` (its ``hicache_storage_backend_extra_config`` as a table,
    None when unset or not JSON). Empty when the worker did not answer (the stored values are kept)."""
    if info is None:
        return {}
    try:
        extra = json.loads(info.get("hicache_storage_backend_extra_config") or "null")
    except ValueError:
        extra = None
    return {
        "storage_backend": info.get("hicache_storage_backend") or "",
        "storage_extra_config": extra if isinstance(extra, dict) else None,
    }


def hicache_report(w: WorkerSpec, info: dict) -> dict:
    """The HiCache settings the worker reports, as the control plane takes them: ``{"config",
    "unreported"}`` (``engine.server.contract.reported_hicache_config``) from its ``/server_info`` body
    ``info``; an upstream SGLang worker's live storage view (``GET /hicache/storage-backend``, with its
    admin key) goes along, since upstream's ``/server_info`` keeps its startup values."""
    storage = None
    if "hicache" not in info and info.get("enable_hierarchical_cache"):
        storage = storage_backend(local_url(w), w.admin_api_key)
    config, unreported = reported_hicache_config(info, storage)
    return {"config": config, "unreported": unreported}


def role_of(w: WorkerSpec, info: dict | None) -> str:
    """The role the worker reports (``disaggregation_mode`` in its /server_info; ``encoder`` for an EPD
    encoder, whose /server_info says ``encoder_only``), else the spec's."""
    if (info or {}).get("encoder_only"):
        return ENCODER
    return ROLE_OF_MODE.get(str((info or {}).get("disaggregation_mode")), w.role)


def worker_devices(w: WorkerSpec, info: dict | None = None) -> list[int]:
    """GPU indexes the worker's ranks hold, rank 0 first: ``--base-gpu-id`` .. + ``--tp-size`` - 1 of a
    ``--device cuda`` worker (as its ``/server_info`` reports them, else its spec's); [] on the CPU."""
    src = info or {}
    if src.get("device", w.device) != "cuda":
        return []
    base = int(src.get("base_gpu_id", w.base_gpu_id))
    return list(range(base, base + int(src.get("tp_size") or w.tp_size)))


def worker_record(w: WorkerSpec, info: dict | None = None) -> dict:
    """The worker object of the register call (the admin key lets the control plane run operations, the
    API key lets a rebalance switch the worker's role and send it its canary; ``command_line`` and
    ``launch_flags`` let it restart the worker with other flags);
    ``info`` is the worker's ``/server_info`` (its attached L3 backend and its HiCache settings go along)."""
    record = {
        "name": w.name,
        "url": w.url,
        "role": role_of(w, info),
        "model_name": w.model_name or str((info or {}).get("served_model_name") or "")[:200],
        "page_size": w.page_size,
        "tp_size": int((info or {}).get("tp_size") or w.tp_size),
        "devices": worker_devices(w, info),
        "engine": w.engine,
        "engine_version": str((info or {}).get("version") or w.engine_version)[:50],
        **storage_fields(info),
        "command_line": list(w.flags),  # secrets never are on it: they go through the environment
        "launch_flags": flag_table(w),
    }
    if info is not None:
        record["capabilities"] = capabilities(local_url(w), info, w.admin_api_key)
        record["hicache"] = hicache_report(w, info)
    if w.admin_api_key:
        record["admin_key"] = w.admin_api_key
    if w.api_key:
        record["api_key"] = w.api_key
    return record


class Agent:
    def __init__(self, spec: FleetSpec, client: ControlPlaneClient, supervisor: Supervisor | None = None):
        self.spec = spec
        # flag changes restart-with-flags requests made in earlier runs (engine/agent/flag_overrides.py)
        self.overrides = FlagOverrides(spec.log_dir, {w.name: w.flags for w in spec.workers})
        spec.workers = [self.overrides.applied(w) for w in spec.workers]
        self.supervisor = supervisor or Supervisor(
            managed(spec), health_interval_s=spec.health_interval_s, unhealthy_after=spec.unhealthy_after
        )
        self.host = host_facts(spec.host_name, spec.address)
        # (restart, request_seq) of each heartbeat answer, in order, for the main thread
        self.restarts: queue.Queue[tuple[list[dict], dict]] = queue.Queue()
        # (worker URL, role it reports, spec generation read before) of workers running another role than
        # their spec's (switched in place), for the main thread to adopt
        self.adoptions: queue.Queue[tuple[str, str, int]] = queue.Queue()
        self.spec_gen: dict[str, int] = {}  # worker URL -> bumped whenever the main thread changes its spec
        self.acks_lock = threading.Lock()
        self.seen: dict[str, int] = {}  # worker URL -> newest request_seq fully processed
        self.applied: dict[str, int] = {}  # worker URL -> newest restart request seq carried out
        # Restarts with other flags (heartbeat answers' ``flags``): each request list, in order, for the main
        # thread; per worker URL the newest request taken, carried out, failed (and why), and the request
        # whose new process has not answered /health yet (worker name -> (URL, seq)).
        self.flag_requests: queue.Queue[list[dict]] = queue.Queue()
        self.flags_taken: dict[str, int] = {}
        self.flags_applied: dict[str, int] = {}
        self.flags_failed: dict[str, tuple[int, str]] = {}
        self.flags_starting: dict[str, tuple[str, int]] = {}
        self.reporter = Reporter(
            client,
            self._registration,
            self._live_urls,
            down_urls=self._down_urls,
            observed=self._observed,
            role_acks=self._role_acks,
            on_role_requests=lambda restart, request_seq: self.restarts.put((restart, request_seq)),
            flag_acks=self._flag_acks,
            on_flag_requests=self.flag_requests.put,
            heartbeat_interval_s=spec.heartbeat_interval_s,
        )
        self.stopping = threading.Event()
        self.trace_cursor: dict[str, int] = {}

    def _running(self) -> list[WorkerSpec]:
        running = set(self.supervisor.running())
        return [w for w in self.spec.workers if w.name in running]

    def _registration(self) -> tuple[dict, list[dict]]:
        return self.host, [worker_record(w, server_info(local_url(w))) for w in self._running()]

    def _live_urls(self) -> list[str]:
        return [w.url for w in self._running()]

    def _observed(self) -> dict[str, dict]:
        """What each running worker that answers /server_info reports (reporter thread, every heartbeat):
        ``{"roles": URL -> role, "hicache": URL -> hicache_report}``. A role other than the spec's (the
        worker switched in place) is queued for the main thread to adopt."""
        running = self._running()
        gens = {w.url: self.spec_gen.get(w.url, 0) for w in running}  # read before the workers are asked
        infos = {w.url: info for w in running if (info := server_info(local_url(w)))}
        roles = {w.url: role_of(w, infos[w.url]) for w in running if w.url in infos}
        for w in running:
            if w.url in roles and roles[w.url] != w.role:
                self.adoptions.put((w.url, roles[w.url], gens[w.url]))
        hicache = {w.url: hicache_report(w, infos[w.url]) for w in running if w.url in infos}
        return {"roles": roles, "hicache": hicache}

    def adopt_live_roles(self) -> None:
        """Main thread: a worker that switched role in place (``/pd_role_switch``, a rebalance) keeps that
        role: its spec and the command its crash restarts use are rebuilt for it, the running process left
        alone. An observation older than the worker's last spec change (a restart in another role since)
        is dropped."""
        while True:
            try:
                url, role, gen = self.adoptions.get_nowait()
            except queue.Empty:
                return
            i = next((i for i, w in enumerate(self.spec.workers) if w.url == url), None)
            if i is None or self.spec.workers[i].role == role or self.spec_gen.get(url, 0) != gen:
                continue
            old = self.spec.workers[i]
            try:
                new = with_role(old, role)
            except ValueError as exc:
                log.error("%s runs as %s, which its flags cannot restart it in: %s", old.name, role, exc)
                continue
            self._set_spec(i, new)
            self.supervisor.set_command(old.name, command(new))
            log.info("%s: switched in place %s -> %s; restarts keep %s", old.name, old.role, role, role)

    def _set_spec(self, i: int, new: WorkerSpec) -> None:
        self.spec.workers[i] = new
        self.spec_gen[new.url] = self.spec_gen.get(new.url, 0) + 1

    def _role_acks(self) -> dict[str, dict]:
        """URL -> {seen, applied} of each worker a heartbeat answer named (reporter thread)."""
        with self.acks_lock:
            return {url: {"seen": seq, "applied": self.applied.get(url, 0)} for url, seq in self.seen.items()}

    def restart_in_roles(self) -> None:
        """Main thread: process the heartbeat answers in order: restart every worker asked to run in another
        role, then acknowledge the answer's request generations as seen."""
        while True:
            try:
                restart, request_seq = self.restarts.get_nowait()
            except queue.Empty:
                return
            for req in restart:
                i = next((i for i, w in enumerate(self.spec.workers) if w.url == req.get("worker_url")), None)
                if i is None:
                    continue  # not ours
                if self.spec.workers[i].role != req.get("role") and not self._restart(i, req["role"]):
                    continue
                with self.acks_lock:
                    self.applied[req["worker_url"]] = max(self.applied.get(req["worker_url"], 0), req["seq"])
            with self.acks_lock:
                for url, seq in request_seq.items():
                    self.seen[url] = max(self.seen.get(url, 0), seq)

    def _restart(self, i: int, role: str) -> bool:
        """Restart spec worker `i` as `role` (stop, then start with flags rebuilt); False if it cannot."""
        old = self.spec.workers[i]
        try:
            new = with_role(old, role)
        except ValueError as exc:
            log.error("cannot restart %s as %s: %s", old.name, role, exc)
            return False
        self._set_spec(i, new)
        self._log([self.supervisor.replace(old.name, command(new), f"role {old.role} -> {new.role}")])
        self.reporter.heartbeat_now()
        return True

    def _flag_acks(self) -> dict[str, dict]:
        """URL -> {applied, failed, failure} of each worker a flags request named (reporter thread)."""
        with self.acks_lock:
            urls = set(self.flags_applied) | set(self.flags_failed)
            return {
                url: {
                    "applied": self.flags_applied.get(url, 0),
                    "failed": self.flags_failed.get(url, (0, ""))[0],
                    "failure": self.flags_failed.get(url, (0, ""))[1],
                }
                for url in urls
            }

    def restart_with_flags(self) -> None:
        """Main thread: carry out the heartbeat answers' flags requests in order. A request the agent took
        already (same or older generation) is skipped; flags its engine refuses (:func:`with_flags`) fail at
        once with the worker left running; flags the worker already runs, running, are carried out as they
        are (starting with them for an earlier request: that start answers this one too); else the worker
        is stopped and started with them, and the request is carried out once it answers /health, failed
        if it exits (or is not healthy in time) before that (:meth:`_log`)."""
        while True:
            try:
                requests = self.flag_requests.get_nowait()
            except queue.Empty:
                return
            for req in requests:
                url, seq = req.get("worker_url"), int(req.get("seq") or 0)
                i = next((i for i, w in enumerate(self.spec.workers) if w.url == url), None)
                if i is None or seq <= self.flags_taken.get(url, 0):
                    continue
                self.flags_taken[url] = seq
                old = self.spec.workers[i]
                try:
                    new = with_flags(old, list(req.get("flags") or []))
                except ValueError as exc:
                    log.error("%s: flags request #%d refused: %s", old.name, seq, exc)
                    self._flags_outcome(url, seq, f"refused by the agent: {exc}")
                    continue
                if new.flags == old.flags and old.name in self.supervisor.running():
                    self._flags_outcome(url, seq, None)
                    continue
                if new.flags == old.flags and old.name in self.flags_starting:  # starting with them now
                    self.flags_starting[old.name] = (url, seq)
                    continue
                self._set_spec(i, new)
                self.flags_starting[old.name] = (url, seq)
                self._log([self.supervisor.replace(old.name, command(new), f"flags request #{seq}")])
                self.reporter.heartbeat_now()

    def _last_error(self, name: str) -> str:
        """``": <line>"``: the last line of worker ``name``'s log that says error (its own words for why it
        exited; the log never holds a secret), or "" when none does."""
        try:
            with open(os.path.join(self.spec.log_dir, f"worker-{name}.log"), errors="replace") as f:
                tail = f.readlines()[-200:]
        except OSError:
            return ""
        lines = [ln.strip() for ln in tail if "error" in ln.lower()]
        return f": {lines[-1][:500]}" if lines else ""

    def _flags_outcome(self, url: str, seq: int, failure: str | None) -> None:
        """Record request `seq` of `url` as carried out (`failure` None) or failed, for the heartbeat."""
        failure = None if failure is None else failure[:1900]  # the control plane takes up to 2000 chars
        if failure is None:  # kept for the agent's next run (main thread)
            w = next((w for w in self.spec.workers if w.url == url), None)
            if w is not None:
                self.overrides.record(w.name, w.flags)
        with self.acks_lock:
            if failure is None:
                self.flags_applied[url] = max(self.flags_applied.get(url, 0), seq)
            else:
                self.flags_failed[url] = (seq, failure)
        self.reporter.heartbeat_now()

    def _down_urls(self) -> list[str]:
        """Workers this agent runs that are not serving (crashed, unhealthy, restarting)."""
        running = set(self.supervisor.running())
        return [w.url for w in self.spec.workers if w.name not in running]

    def _report_loop(self) -> None:
        next_trace = 0.0
        while not self.stopping.is_set():
            now = time.monotonic()
            if now >= next_trace:
                next_trace = now + self.spec.trace_interval_s
                for w in self._running():
                    if "--record-trace" in w.flags and self.reporter.registered:
                        self._ship_trace(w)
            self.reporter.tick()
            self.stopping.wait(TICK_S)

    def _ship_trace(self, w: WorkerSpec) -> None:
        cursor = self.trace_cursor.get(w.name, 0)
        data = recorded_trace(local_url(w), cursor)
        if data is None:
            return
        if data["next"] < cursor:  # the worker restarted: its sequence starts again
            cursor = 0
            data = recorded_trace(local_url(w), 0) or {"next": 0, "requests": []}
        rows = data["requests"]
        first_seq = data["next"] - len(rows)  # the rows are the contiguous sequence numbers up to next
        for start in range(0, len(rows), TRACE_BATCH):
            batch = rows[start : start + TRACE_BATCH]
            try:
                self.reporter.client.push_trace(w.url, batch, data.get("block_tokens", 512))
            except ControlPlaneDown:
                return  # retried from the cursor next time
            except ControlPlaneRejected as exc:
                log.warning("recorded trace of %s rejected (skipped): %s", w.url, exc)
            self.trace_cursor[w.name] = first_seq + start + len(batch)
        self.trace_cursor[w.name] = data["next"]

    def write_state(self) -> None:
        state = {
            "agent_pid": os.getpid(),
            "updated_at": time.time(),
            "host": self.host,
            "control_plane": self.reporter.status(),
            "workers": [
                {**snap, "url": w.url, "local_url": local_url(w)}
                for w, snap in zip(self.spec.workers, self.supervisor.snapshot(), strict=True)
            ],
        }
        tmp = f"{self.spec.state_file}.tmp"
        with open(tmp, "w") as f:
            json.dump(state, f, indent=1)
        os.replace(tmp, self.spec.state_file)

    def run(self) -> int:
        os.makedirs(self.spec.log_dir, exist_ok=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stopping.set())
        log.info(
            "host %s: %d CPUs, %.1f GiB, %d GPUs; starting %d workers",
            self.host["name"],
            self.host["cpu_count"],
            self.host["memory_bytes"] / 2**30,
            len(self.host["gpus"]),
            len(self.spec.workers),
        )
        self._log(self.supervisor.start_all())
        reporter = threading.Thread(target=self._report_loop, name="reporter", daemon=True)
        reporter.start()
        try:
            while not self.stopping.is_set():
                self.restart_in_roles()
                self.restart_with_flags()
                self.adopt_live_roles()
                self._log(self.supervisor.poll())
                self.write_state()
                self.stopping.wait(TICK_S)
        finally:
            self.stopping.set()
            log.info("stopping workers")
            self._log(self.supervisor.stop())
            reporter.join(timeout=10)
            self.write_state()
        return 0

    def _log(self, events) -> None:
        for e in events:
            if e.kind == "crashed":
                log.error("worker %s crashed: %s", e.name, e.detail)
            else:
                log.info("worker %s %s %s", e.name, e.kind, e.detail)
            starting = self.flags_starting.pop(e.name, None) if e.kind in ("healthy", "crashed") else None
            if starting is not None:  # the first start with a flags request's command line
                why = None if e.kind == "healthy" else f"the new process {e.detail}{self._last_error(e.name)}"
                self._flags_outcome(*starting, why)
            if e.kind == "healthy":
                self.reporter.reregister()
            elif e.kind == "crashed":
                self.reporter.heartbeat_now()
