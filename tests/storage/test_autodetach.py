"""The timing of the automatic L3 detach/re-attach (``auto_detach_after_s``), on an injected clock: the
breaker must stay away from closed for the whole threshold (failed half-open probes do not restart it),
probes back off from the breaker's open window up to 30 s, a probe is bounded by the breaker's latency
limit, and a hung probe is never joined by a second one."""

import threading

from engine.cache.storage.autodetach import AutoDetach, AutoDetachSettings, probe_store
from engine.cache.storage.health import BreakerSettings, StorageHealth


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Store:
    """A backend stand-in: ``down`` makes ``batch_exists`` count an error (as Mooncake does for a dead
    master); ``gate`` makes it wait for the event (a master that accepts and never answers)."""

    def __init__(self):
        self.down = False
        self.errors = 0
        self.gate: threading.Event | None = None

    def get_stats(self):
        return {"errors": self.errors}

    def batch_exists(self, keys, extra_info=None):
        if self.gate is not None:
            self.gate.wait(10)
        if self.down:
            self.errors += 1
        return 0


class Kept:
    def __init__(self, instance):
        self.name, self.instance = "mooncake", instance


def _open_breaker(clock):
    health = StorageHealth(BreakerSettings(failures=1, open_s=1.0), clock=clock)
    health.record(False, 0.01, "exists: rc=-900")
    return health


def test_detach_is_due_only_after_the_breaker_stayed_away_from_closed_for_the_threshold():
    clock = Clock()
    auto = AutoDetach(AutoDetachSettings(after_s=10.0, probe_s=1.0), clock=clock)
    health = StorageHealth(BreakerSettings(failures=1, open_s=1.0), clock=clock)
    assert not auto.due(health) and health.down_for() is None  # closed
    health.record(False, 0.01)
    clock.now += 1.0
    assert health.allow() and health.state == "half_open"
    health.record(False, 0.01)  # a failed probe reopens it, the count goes on
    clock.now += 8.9
    assert not auto.due(health)
    clock.now += 0.1
    assert auto.due(health) and abs(health.down_for() - 10.0) < 1e-9
    health.recovered()  # a close in between starts the count again
    assert not auto.due(health) and health.down_for() is None
    assert not auto.due(None)


def test_probes_back_off_from_the_open_window_to_thirty_seconds_and_a_success_ends_them():
    clock = Clock()
    settings = AutoDetachSettings(after_s=5.0, probe_s=1.0, timeout_s=1.0)
    auto = AutoDetach(settings, clock=clock, wall=lambda: 1e9)
    store = Store()
    store.down = True
    auto.detached(Kept(store))
    status = auto.status()
    assert status["detached"] and status["detached_since"] == 1e9 and status["detaches"] == 1
    assert auto.poll() is None  # the first probe waits one open window
    waits = []
    for _ in range(7):
        clock.now += auto.next_probe_in()
        assert auto.poll() is False
        waits.append(auto.next_probe_in())
    assert waits == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert auto.status()["failed_probes"] == 7 and "counted an error" in auto.last_probe_failure
    store.down = False
    clock.now += 30.0
    assert auto.poll() is True and auto.answered()
    assert auto.poll() is None and auto.next_probe_in() is None  # no more probes: the scheduler re-attaches
    assert auto.reattached().instance is store
    status = auto.status()
    assert not status["detached"] and status["detached_since"] is None and status["attaches"] == 1


def test_a_hung_probe_fails_within_the_timeout_and_no_second_probe_starts_until_it_returns():
    clock = Clock()
    auto = AutoDetach(AutoDetachSettings(after_s=0.0, probe_s=1.0, timeout_s=0.05), clock=clock)
    store = Store()
    store.gate = threading.Event()
    auto.detached(Kept(store))
    clock.now += 1.0
    assert auto.poll() is False and "no answer within 0.05 s" in auto.last_probe_failure
    clock.now += 60.0
    assert not auto.probe_due() and auto.poll() is None  # the first one still hangs
    store.gate.set()
    hung = auto._hung
    hung.join(5)
    assert auto.probe_due() and auto.poll() is True


def test_a_probe_that_raises_fails_and_says_why():
    class Broken(Store):
        def batch_exists(self, keys, extra_info=None):
            raise ConnectionError("master unreachable")

    ok, reason, hung = probe_store(Broken(), 1.0)
    assert (ok, hung) == (False, None) and reason == "probe: master unreachable"
    assert probe_store(Store(), 1.0) == (True, "", None)


def test_an_operators_detach_cancels_the_episode_and_returns_the_kept_backend():
    clock = Clock()
    auto = AutoDetach(AutoDetachSettings(after_s=1.0), clock=clock)
    health = _open_breaker(clock)
    clock.now += 1.0
    assert auto.due(health)
    kept = Kept(Store())
    auto.detached(kept)
    assert not auto.due(health)  # already out
    assert auto.cancel() is kept and auto.kept is None and auto.next_probe_in() is None
    assert auto.status()["attaches"] == 0


def test_recovered_closes_the_breaker_and_starts_the_backup_ramp():
    clock = Clock()
    health = _open_breaker(clock)
    health.recovered()
    snap = health.snapshot()
    assert snap.state == "closed" and snap.ramp_share == 0.1 and snap.transitions["closed"] == 1


def test_the_exporter_counts_detaches_and_attaches_and_shows_the_time_out_only_while_out():
    from engine.server.metrics import _breaker

    clock = Clock()
    auto = AutoDetach(AutoDetachSettings(after_s=1.0), clock=clock)
    health = _open_breaker(clock)

    def families():
        snap = {"storage_backend": "mooncake", **vars(health.snapshot()), "auto_detach": auto.status()}
        return {f.name: f.samples[0].value for f in _breaker("m", snap)}

    assert families()["sglang:hicache_storage_auto_detach"] == 0
    assert "sglang:hicache_storage_auto_detached_seconds" not in families()
    auto.detached(Kept(Store()))
    clock.now += 7.5
    got = families()
    assert got["sglang:hicache_storage_auto_detach"] == 1 and got["sglang:hicache_storage_auto_attach"] == 0
    assert got["sglang:hicache_storage_auto_detached_seconds"] == 7.5
    auto.probed(True)
    auto.reattached()
    got = families()
    assert got["sglang:hicache_storage_auto_attach"] == 1
    assert "sglang:hicache_storage_auto_detached_seconds" not in got
