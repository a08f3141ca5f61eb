"""Automatic detach and re-attach of a worker's L3 backend, only where the operator allows it.

Extra-config key ``auto_detach_after_s`` (seconds, a number >= 0; absent: never). When the breaker
(``health.py``) has not been closed for that long (open and half-open alike: its failed probes do not restart
the count), the worker takes the backend out itself, as a runtime detach does, and keeps it (not closed): a
background thread probes it, one bounded call at a time (``batch_exists`` of one key, failed when it raises,
when the backend counts an error during it or when it does not answer within the breaker's ``latency_s``),
first ``open_s`` after the detach, then after twice as long per failed probe, at most ``MAX_PROBE_S``. When a
probe succeeds the scheduler re-installs that backend with the config it was attached with and closes the
breaker as a successful half-open probe would, so backups ramp up (``breaker_ramp_s``).

:class:`AutoDetach` is the timing and bookkeeping (clock injected, no thread of its own); :class:`Prober`
runs its probes on a daemon thread. The scheduler side (when to detach, agreement across ranks, the
re-attach) is :class:`~engine.cache.admin.StorageAttachment`'s. Nothing here runs on the scheduler thread
or in a request's path: a probe that hangs on a store that accepts connections and never answers holds
only its own thread, and no second probe starts until it returns.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from engine.cache.storage.health import StorageHealth

logger = logging.getLogger(__name__)

PROBE_KEY = "kvfleet-l3-probe"  # never written: a live store answers "0 pages exist"
MAX_PROBE_S = 30.0  # longest wait between two probes


@dataclass
class AutoDetachSettings:
    """``after_s``: breaker not closed this long -> detach; ``probe_s``: first wait before a probe (the
    breaker's ``open_s``); ``timeout_s``: a probe slower than this failed (the breaker's ``latency_s``)."""

    after_s: float
    probe_s: float = 1.0
    timeout_s: float = 1.0
    max_probe_s: float = MAX_PROBE_S


def probe_store(instance: Any, timeout_s: float) -> tuple[bool, str, threading.Thread | None]:
    """One bounded probe of ``instance`` (a ``HiCacheStorage``): ``(ok, reason, hung)`` where ``hung`` is the
    probe's thread when it had not returned after ``timeout_s`` seconds (else None). ``reason`` says why
    it failed ("" when ok)."""
    outcome: dict = {}

    def call() -> None:
        try:
            errors = instance.get_stats().get("errors", 0)
            instance.batch_exists([PROBE_KEY])
            if instance.get_stats().get("errors", 0) > errors:
                outcome["reason"] = "probe: the backend counted an error"
            else:
                outcome["ok"] = True
        except Exception as exc:  # a store call may raise anything
            outcome["reason"] = f"probe: {exc}"

    began = time.perf_counter()
    thread = threading.Thread(target=call, name="hicache-l3-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return False, f"probe: no answer within {timeout_s:g} s", thread
    took = time.perf_counter() - began
    if outcome.get("ok") and took > timeout_s:
        return False, f"probe took {took:.2f} s (> {timeout_s:g} s)", None
    return bool(outcome.get("ok")), outcome.get("reason", ""), None


class AutoDetach:
    """One worker's auto detach/re-attach state. ``kept``: the backend taken out automatically (a
    ``PreparedBackend``), None while attached. Counters ``detaches`` / ``attaches`` only grow."""

    def __init__(self, settings: AutoDetachSettings, clock=time.monotonic, wall=time.time) -> None:
        self.settings = settings
        self._clock, self._wall = clock, wall
        self._lock = threading.Lock()
        self.kept: Any = None
        self.detaches = self.attaches = 0
        self.probes = self.failed_probes = 0
        self.last_probe_failure: str | None = None
        self._detached_at = 0.0  # monotonic, while kept
        self._detached_wall: float | None = None  # epoch s, while kept
        self._wait = settings.probe_s
        self._next_probe_at = 0.0
        self._answered = False  # a probe succeeded since the detach
        self._hung: threading.Thread | None = None

    # -- attached --------------------------------------------------------------------------------------------
    def due(self, health: StorageHealth | None) -> bool:
        """Whether an attached backend should be taken out now: its breaker not closed for ``after_s``."""
        down = health.down_for() if health is not None else None
        return self.kept is None and down is not None and down >= self.settings.after_s

    def detached(self, kept: Any) -> None:
        """The scheduler took ``kept`` out: probing starts ``probe_s`` from now."""
        with self._lock:
            self.kept, self.detaches = kept, self.detaches + 1
            self._detached_at, self._detached_wall = self._clock(), self._wall()
            self._wait = self.settings.probe_s
            self._next_probe_at = self._detached_at + self._wait
            self._answered = False

    # -- detached --------------------------------------------------------------------------------------------
    def probe_due(self) -> bool:
        """A probe may start now: detached, none answered yet, the wait over, no earlier probe still hung."""
        with self._lock:
            if self.kept is None or self._answered:
                return False
            if self._hung is not None and self._hung.is_alive():
                return False
            return self._clock() >= self._next_probe_at

    def poll(self) -> bool | None:
        """Run one probe if one is due (on the caller's thread; it waits at most ``timeout_s``): its result,
        or None when none was due."""
        if not self.probe_due():
            return None
        kept = self.kept
        ok, reason, hung = probe_store(kept.instance, self.settings.timeout_s)
        self.probed(ok, reason, hung)
        return ok

    def probed(self, ok: bool, reason: str = "", hung: threading.Thread | None = None) -> None:
        """Record a probe's outcome: success lets the scheduler re-attach; failure doubles the wait."""
        with self._lock:
            self.probes += 1
            self._hung = hung
            if ok:
                self._answered = True
                return
            self.failed_probes += 1
            self.last_probe_failure = reason or "probe failed"
            self._wait = min(self.settings.max_probe_s, self._wait * 2)
            self._next_probe_at = self._clock() + self._wait

    def answered(self) -> bool:
        """A probe succeeded since the detach: the scheduler may re-attach."""
        with self._lock:
            return self.kept is not None and self._answered

    def reattached(self) -> Any:
        """The scheduler re-installed the kept backend: returns it and forgets it."""
        with self._lock:
            kept, self.kept = self.kept, None
            self.attaches += 1 if kept is not None else 0
            self._detached_wall, self._answered = None, False
            return kept

    def cancel(self) -> Any:
        """An operator's detach or attach ends the episode: returns the kept backend (theirs to close)."""
        with self._lock:
            kept, self.kept = self.kept, None
            self._detached_wall, self._answered = None, False
            return kept

    def next_probe_in(self) -> float | None:
        """Seconds until the next probe may start (0 when due); None while attached or answered."""
        with self._lock:
            if self.kept is None or self._answered:
                return None
            return max(0.0, self._next_probe_at - self._clock())

    def status(self) -> dict:
        """``after_s``, ``detached`` (bool), ``backend`` (kept name or None), ``detached_since`` (epoch s or
        None), ``detached_for_s`` (s or None), ``detaches``, ``attaches``, ``probes``, ``failed_probes``,
        ``last_probe_failure``."""
        with self._lock:
            kept = self.kept
            return {
                "after_s": self.settings.after_s,
                "detached": kept is not None,
                "backend": kept.name if kept is not None else None,
                "detached_since": self._detached_wall if kept is not None else None,
                "detached_for_s": self._clock() - self._detached_at if kept is not None else None,
                "detaches": self.detaches,
                "attaches": self.attaches,
                "probes": self.probes,
                "failed_probes": self.failed_probes,
                "last_probe_failure": self.last_probe_failure,
            }


class Prober:
    """A daemon thread calling ``auto.poll()`` whenever a probe is due, until ``stop()``."""

    def __init__(self, auto: AutoDetach) -> None:
        self.auto = auto
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hicache-l3-reprobe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            wait = self.auto.next_probe_in()
            if wait is None:
                return  # re-attached, cancelled or answered: the scheduler takes it from here
            if self._stop.wait(min(max(wait, 0.01), 1.0)):
                return
            try:
                ok = self.auto.poll()
            except Exception:
                logger.exception("L3 re-attach probe failed unexpectedly")
                continue
            if ok:
                logger.info("L3 backend answered a probe: it is re-attached at the next scheduler step")

    def stop(self) -> None:
        """Ask the thread to end (it does not wait on a hung probe, whose own thread is a daemon)."""
        self._stop.set()
