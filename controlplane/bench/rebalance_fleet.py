"""The real PD fleet of the rebalance benchmark (controlplane/bench/rebalance.py) and of the rebalance tests
on real processes: SmolLM2 engines (Mooncake over TCP), the real router (smg) in PD mode in front of them,
their inventory rows, and clients sending greedy requests through the router while a rebalance runs, each
answer checked against the text recorded before it.

:func:`register` runs after django.setup(), on the caller's database.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import httpx

from engine.bench.launcher import ServerProcess
from engine.fleet.router import RouterProcess
from engine.ports import free_port

# float32: every answer is checked token for token against one recorded before, and the default on a CPU
# (bfloat16 on the GGUF's int4 blocks) rounds by the batch's rows, so a near-tie can flip between batches
ENGINE_FLAGS = ["--model-path", "smollm2", "--dtype", "float32", "--page-size", "16", "--random-seed", "0",
                "--enable-metrics", "--max-total-tokens", "2048"]  # fmt: skip


def start_engines(
    roles: dict[str, str], *, switch: bool, env: dict | None = None
) -> dict[str, ServerProcess]:
    """One healthy engine per ``roles`` entry (name -> prefill | decode), each with its own bootstrap port
    (kept when it becomes a decode, reused if it becomes a prefill again), with --enable-pd-role-switch when
    ``switch``; name -> process. The caller stops them (:func:`stop_engines`); when one fails to start, the
    ones started before it are stopped here."""
    engines: dict[str, ServerProcess] = {}
    try:
        for name, role in roles.items():
            flags = [*ENGINE_FLAGS, *(["--enable-pd-role-switch"] if switch else []), "--disaggregation-mode",
                     role, "--disaggregation-bootstrap-port", str(free_port())]  # fmt: skip
            engines[name] = ServerProcess(flags, timeout=600, env=env).__enter__()
    except BaseException:
        stop_engines(engines)
        raise
    return engines


def stop_engines(engines: dict[str, ServerProcess]) -> None:
    for proc in engines.values():
        proc.__exit__(None, None, None)


def server_roles(urls: dict[str, str]) -> dict[str, str]:
    """name -> the role each worker runs now (its /server_info disaggregation_mode)."""
    return {name: httpx.get(f"{url}/server_info", timeout=10).json()["disaggregation_mode"]
            for name, url in urls.items()}  # fmt: skip


def router_workers(router_url: str) -> dict[str, str]:
    """URL -> worker type (prefill | decode) of every worker the router lists (those smg is draining out,
    ``"status": "draining"``, left out: it selects them no more)."""
    workers = httpx.get(f"{router_url}/workers", timeout=5).json()["workers"]
    return {w["url"].rstrip("/"): w["worker_type"] for w in workers if w.get("status") != "draining"}


def start_router(urls: dict[str, str], roles: dict[str, str], timeout: float = 120) -> RouterProcess:
    """The real router (smg) in PD mode (round robin) over ``urls`` (name -> URL) in ``roles``: each prefill
    with the bootstrap port its /server_info reports, in the order of ``urls``; returns once it lists all of
    them. ``close()`` (or a ``with`` block) stops it."""
    args = ["--pd-disaggregation", "--policy", "round_robin"]
    for name, url in urls.items():
        if roles[name] == "prefill":
            port = httpx.get(f"{url}/server_info", timeout=10).json()["disaggregation_bootstrap_port"]
            args += ["--prefill", url, str(port)]
    args += [arg for name, url in urls.items() if roles[name] == "decode" for arg in ("--decode", url)]
    return RouterProcess(args, min_workers=len(urls), timeout=timeout)


def register(router_url: str, urls: dict[str, str], roles: dict[str, str], name: str):
    """The router's inventory row (``name``, PD mode) and one worker row per ``urls`` entry in its role
    (name -> URL; a row an agent registered already, found by URL, is updated by a queryset update, as its
    agent may write it meanwhile); returns (router, name -> worker)."""
    from controlplane.inventory.models import EngineWorker, Router

    router = Router.objects.create(name=name, url=router_url, mode="pd")
    for worker, url in urls.items():
        fields = {"name": worker, "router": router, "role": roles[worker]}
        if not EngineWorker.objects.filter(url=url).update(**fields):
            EngineWorker.objects.create(url=url, **fields)
    return router, {w.name: w for w in EngineWorker.objects.filter(url__in=urls.values())}


def greedy_texts(router_url: str, prompts: list[str], sampling_params: dict) -> dict[str, str]:
    """prompt -> the text the fleet answers it through the router (greedy: the text every later answer
    must be), in the order of ``prompts``."""
    texts = {}
    for text in prompts:
        r = httpx.post(f"{router_url}/generate", json={"text": text, "sampling_params": sampling_params},
                       timeout=120)  # fmt: skip
        r.raise_for_status()
        texts[text] = r.json()["text"]
    return texts


@dataclass(frozen=True)
class Answer:
    started: float  # time.monotonic() when the request was sent
    ok: bool  # HTTP 200 and the expected text
    detail: str  # "200", or the status and the start of the body, the wrong text or the error


class RouterLoad:
    """``clients`` threads sending the prompts of ``expected`` (prompt -> its greedy text, from
    :func:`greedy_texts`) through the router's /generate back to back until stopped: client i sends prompt
    i, i + clients, ... (round and round); a context manager. Every request adds an :class:`Answer` to
    ``answers``. ``stream``: streamed requests, the time to the first chunk in ``ttft`` and the gaps
    between later chunks in ``itl`` (s). A request in flight when it stops gets ``timeout`` + 30 s."""

    def __init__(
        self,
        router: str,
        expected: dict[str, str],
        sampling_params: dict,
        clients: int = 2,
        *,
        stream: bool = False,
        timeout: float = 120.0,
    ):
        self.router, self.expected, self.sampling_params = router, expected, sampling_params
        self.prompts, self.stream, self.timeout = list(expected), stream, timeout
        self.answers: list[Answer] = []
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _post(self, client: httpx.Client, text: str) -> tuple[bool, str]:
        body = {"text": text, "sampling_params": self.sampling_params}
        if not self.stream:
            r = client.post(f"{self.router}/generate", json=body)
            if r.status_code != 200:
                return False, f"HTTP {r.status_code}: {r.text[:200]}"
            out = r.json()["text"]
        else:
            started, last, out = time.perf_counter(), None, None
            with client.stream("POST", f"{self.router}/generate", json={**body, "stream": True}) as r:
                if r.status_code != 200:
                    return False, f"HTTP {r.status_code}: {r.read()[:200]!r}"
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    if last is None:
                        self.ttft.append(now - started)
                    else:
                        self.itl.append(now - last)
                    last, out = now, json.loads(line[6:])["text"]
        return (True, "200") if out == self.expected[text] else (False, f"wrong text {out!r}")

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=self.timeout) as client:
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    ok, detail = self._post(client, self.prompts[i % len(self.prompts)])
                except (httpx.HTTPError, ValueError) as exc:
                    ok, detail = False, repr(exc)
                self.answers.append(Answer(started, ok, detail))
                i += len(self.threads)

    def __enter__(self) -> RouterLoad:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(self.timeout + 30)

    def failures(self) -> list[Answer]:
        return [a for a in self.answers if not a.ok]

    def check(self) -> None:
        """For tests: AssertionError unless no request failed or answered wrong and the load ran (at least
        one answer per client: on a loaded machine a request can take seconds, so no higher count)."""
        bad = self.failures()
        if bad:
            n = len(self.answers)
            raise AssertionError(f"{len(bad)} of {n} client requests failed or answered wrong: {bad[:3]}")
        if len(self.answers) < len(self.threads):
            raise AssertionError(f"{len(self.answers)} answers from {len(self.threads)} clients")
