"""Health of one worker's L3 backend: a circuit breaker on errors and latency.

States: ``closed`` (calls go through), ``open`` (no call: every hit query is a miss at once and every
backup is dropped and counted), ``half_open`` (one call goes through as a probe). ``failures`` failed
calls in a row open it; a call fails when it raises, when the backend counted an error during it
(``get_stats()["errors"]`` went up: backends report a dead store as misses, not exceptions) or when it took
longer than ``latency_s``. After ``open_s`` seconds open, the next call is the probe: success closes the
breaker, failure opens it again for twice as long (at most ``max_open_s``). Upstream has no breaker: its
workers keep calling a dead or slow store request by request.

After a recovery (half-open -> closed) backups ramp up over ``ramp_s`` seconds instead of all resuming at
once: :meth:`admit_backup` admits a share of the backup pages that grows linearly from ``RAMP_FLOOR`` to
all of them, so a store that just came back is not flooded by every worker's pending writes (the pages
not admitted are dropped and counted, as while open). Lookups and prefetches are not ramped: a read that
hits is what the recovery is for.

Thread-safe (the backup and prefetch threads share one breaker). Times are ``time.monotonic`` seconds.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
STATES = (CLOSED, HALF_OPEN, OPEN)  # their gauge values are the indexes: 0, 1, 2


@dataclass
class BreakerSettings:
    """Extra-config keys ``breaker_failures`` (int >= 1), ``breaker_latency_s``, ``breaker_open_s`` (s)."""

    failures: int = 3
    latency_s: float = 1.0
    open_s: float = 1.0
    max_open_s: float = 30.0
    ramp_s: float = 10.0  # extra-config ``breaker_ramp_s``; 0: backups resume at full rate


RAMP_FLOOR = 0.1  # the share of backup pages admitted right after a recovery


@dataclass
class HealthSnapshot:
    state: str
    transitions: dict = field(default_factory=dict)  # to-state -> count
    calls: int = 0
    failed_calls: int = 0
    short_circuited: int = 0  # hit queries and reads answered "miss" without a call
    dropped_backup_pages: int = 0  # while open, or not admitted during the ramp after a recovery
    ramp_share: float | None = None  # the share of backup pages admitted now, while ramping; else None
    last_failure: str | None = None
    last_failure_age_s: float | None = None


class StorageHealth:
    """The breaker. Use ``allow()`` before a store call, then ``record(ok, seconds, reason)``."""

    def __init__(self, settings: BreakerSettings | None = None, clock=time.monotonic) -> None:
        self.settings = settings or BreakerSettings()
        self._clock = clock
        self._lock = threading.Lock()
        self.state = CLOSED
        self._in_a_row = 0
        self._open_for = self.settings.open_s
        self._retry_at = 0.0
        self._probing = False
        self._snap = HealthSnapshot(CLOSED, {s: 0 for s in STATES})
        self._last_failure_at: float | None = None
        self._ramp_from: float | None = None  # when the last recovery closed the breaker
        self._ramp_credit = 0.0  # pages' worth of admission not yet used
        self._down_since: float | None = None  # when it last left closed (None while closed)

    def allow(self) -> bool:
        """Whether a store call may run now (False counts a short-circuited call)."""
        with self._lock:
            if self.state == OPEN and self._clock() >= self._retry_at:
                self._move(HALF_OPEN)
            if self.state == CLOSED or (self.state == HALF_OPEN and not self._probing):
                self._probing = self.state == HALF_OPEN
                return True
            self._snap.short_circuited += 1
            return False

    def skipping(self) -> bool:
        """True while open with no probe due yet (counted as short-circuited): a caller that would only
        queue work for a store call (a prefetch) skips it at once. Unlike ``allow`` it never starts the
        half-open probe, which the next real call makes."""
        with self._lock:
            if self.state == OPEN and self._clock() < self._retry_at:
                self._snap.short_circuited += 1
                return True
            return False

    def record(self, ok: bool, seconds: float, reason: str = "store call failed") -> None:
        """The outcome of an allowed call; a call slower than ``latency_s`` counts as failed."""
        s = self.settings
        if ok and seconds > s.latency_s:
            ok, reason = False, f"store call took {seconds:.2f} s (> {s.latency_s:g} s)"
        with self._lock:
            self._snap.calls += 1
            probe, self._probing = self._probing, False
            if ok:
                self._in_a_row = 0
                self._recover()
                return
            self._snap.failed_calls += 1
            self._snap.last_failure, self._last_failure_at = reason, self._clock()
            self._in_a_row += 1
            if probe or self.state == HALF_OPEN:
                self._open_for = min(s.max_open_s, self._open_for * 2)
                self._open()
            elif self.state == CLOSED and self._in_a_row >= s.failures:
                self._open()

    def _ramp_share(self) -> float | None:
        """The share of backup pages admitted now (None: not ramping). Call with the lock held."""
        if self._ramp_from is None or self.state != CLOSED or self.settings.ramp_s <= 0:
            return None
        elapsed = self._clock() - self._ramp_from
        if elapsed >= self.settings.ramp_s:
            self._ramp_from = None
            return None
        return RAMP_FLOOR + (1 - RAMP_FLOOR) * elapsed / self.settings.ramp_s

    def admit_backup(self, pages: int) -> bool:
        """Whether a backup of ``pages`` pages may be written now: always, except during the ramp after a
        recovery, where admitted pages track the ramp's share (a credit of share x pages per batch asked,
        spent by the batches admitted). A refused batch is the caller's to drop and count."""
        with self._lock:
            share = self._ramp_share()
            if share is None:
                return True
            self._ramp_credit += share * pages
            if self._ramp_credit >= pages - 1e-9:  # a share x n that sums to n exactly, despite rounding
                self._ramp_credit -= pages
                return True
            return False

    def down_for(self) -> float | None:
        """Seconds since the breaker last left ``closed`` (open and half-open alike: a failed probe does not
        restart it); None while closed."""
        with self._lock:
            return None if self._down_since is None else self._clock() - self._down_since

    def recovered(self) -> None:
        """The store answered a probe made outside the breaker (the auto re-attach's, ``autodetach.py``):
        close as a successful half-open probe does, backup ramp included. No-op while closed."""
        with self._lock:
            self._in_a_row, self._probing = 0, False
            self._recover()

    def _recover(self) -> None:
        """Close after a successful probe and start the backup ramp (lock held); no-op while closed."""
        if self.state != CLOSED:
            self._open_for = self.settings.open_s
            self._move(CLOSED)
            self._ramp_from, self._ramp_credit = self._clock(), 0.0

    def drop_backup(self, pages: int) -> None:
        with self._lock:
            self._snap.dropped_backup_pages += pages

    def snapshot(self) -> HealthSnapshot:
        with self._lock:
            snap = HealthSnapshot(**{**vars(self._snap), "transitions": dict(self._snap.transitions)})
            snap.state = self.state
            snap.ramp_share = self._ramp_share()
            if self._last_failure_at is not None:
                snap.last_failure_age_s = self._clock() - self._last_failure_at
            return snap

    def _open(self) -> None:
        self._retry_at = self._clock() + self._open_for
        self._move(OPEN)

    def _move(self, state: str) -> None:
        if state != self.state:
            if self.state == CLOSED:
                self._down_since = self._clock()
            elif state == CLOSED:
                self._down_since = None
            self.state = state
            self._snap.transitions[state] += 1
