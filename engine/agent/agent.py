"""``kvfleet-agent run``: supervise this host's engine workers and keep the control plane informed.

The main thread supervises (starts, health-checks, restarts) and writes the state file that ``status``
reads; a reporter thread registers the host and its running workers, heartbeats, and pushes each running
worker's ``/metrics`` every ``metrics_interval_s`` seconds, and the new rows of each ``--record-trace``
worker's ``/recorded_trace`` (a cursor per worker moves only once the control plane stored them; rows it
rejects are logged and skipped). SIGINT/SIGTERM stop every worker and exit.

Roles: each worker is registered, and listed in every heartbeat, with the role it reports running
(``/server_info`` ``disaggregation_mode``; the spec's role while it does not answer). A heartbeat answer's
``restart`` entries ({worker_url, role, seq}: the control plane's ``desired_role``, for engines that cannot
switch in place) make the main thread restart that worker with its flags rebuilt for the role
(:func:`engine.agent.spec.with_role`); the new role holds for later crash restarts until the agent itself
restarts (then the spec file's role applies again). A worker that switched role in place
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
import sys
import threading
import time

from engine.agent.host import host_facts
from engine.agent.probe import metrics_text, recorded_trace, server_info
from engine.agent.reporter import ControlPlaneClient, ControlPlaneDown, ControlPlaneRejected, Reporter
from engine.agent.spec import ENCODER, ROLE_OF_MODE, FleetSpec, WorkerSpec, with_role
from engine.agent.supervisor import Managed, Supervisor

log = logging.getLogger("kvfleet.agent")
TICK_S = 0.5
TRACE_BATCH = 5000  # rows per push (the control plane takes up to 10,000)


def local_url(w: WorkerSpec) -> str:
    """Where this host reaches the worker (its bind address; loopback for a wildcard bind)."""
    host = "127.0.0.1" if w.host in ("0.0.0.0", "::", "") else w.host
    return f"http://{host}:{w.port}"


def command(w: WorkerSpec) -> list[str]:
    return [sys.executable, "-m", "engine.launch_server", *w.flags]


def managed(spec: FleetSpec) -> list[Managed]:
    return [
        Managed(
            name=w.name,
            command=command(w),
            health_url=f"{local_url(w)}/health",
            log_path=os.path.join(spec.log_dir, f"worker-{w.name}.log"),
            env=w.env,
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
    API key lets a rebalance switch the worker's role and send it its canary);
    ``info`` is the worker's ``/server_info`` (its attached L3 backend goes along)."""
    record = {
        "name": w.name,
        "url": w.url,
        "role": role_of(w, info),
        "model_name": w.model_name,
        "page_size": w.page_size,
        "tp_size": int((info or {}).get("tp_size") or w.tp_size),
        "devices": worker_devices(w, info),
        **storage_fields(info),
    }
    if w.admin_api_key:
        record["admin_key"] = w.admin_api_key
    if w.api_key:
        record["api_key"] = w.api_key
    return record


class Agent:
    def __init__(self, spec: FleetSpec, client: ControlPlaneClient, supervisor: Supervisor | None = None):
        self.spec = spec
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
        self.reporter = Reporter(
            client,
            self._registration,
            self._live_urls,
            down_urls=self._down_urls,
            roles=self._roles,
            role_acks=self._role_acks,
            on_role_requests=lambda restart, request_seq: self.restarts.put((restart, request_seq)),
            heartbeat_interval_s=spec.heartbeat_interval_s,
            buffer_size=spec.buffer_size,
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

    def _roles(self) -> dict[str, str]:
        """URL -> role of each running worker that answers /server_info (reporter thread). A role other
        than the spec's (the worker switched in place) is queued for the main thread to adopt."""
        running = self._running()
        gens = {w.url: self.spec_gen.get(w.url, 0) for w in running}  # read before the workers are asked
        infos = {w.url: server_info(local_url(w)) for w in running}
        roles = {w.url: role_of(w, infos[w.url]) for w in running if infos.get(w.url)}
        for w in running:
            if w.url in roles and roles[w.url] != w.role:
                self.adoptions.put((w.url, roles[w.url], gens[w.url]))
        return roles

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

    def _down_urls(self) -> list[str]:
        """Workers this agent runs that are not serving (crashed, unhealthy, restarting)."""
        running = set(self.supervisor.running())
        return [w.url for w in self.spec.workers if w.name not in running]

    def _report_loop(self) -> None:
        next_scrape = 0.0
        while not self.stopping.is_set():
            now = time.monotonic()
            if now >= next_scrape:
                next_scrape = now + self.spec.metrics_interval_s
                for w in self._running():
                    text = metrics_text(local_url(w))
                    if text is not None:
                        self.reporter.add_sample(w.url, text)
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
            if e.kind == "healthy":
                self.reporter.reregister()
            elif e.kind == "crashed":
                self.reporter.heartbeat_now()
