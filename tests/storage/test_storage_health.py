"""The L3 circuit breaker: failures in a row and slow calls open it, an open breaker refuses calls until its
window ends, then one probe decides (success closes, failure reopens for twice as long)."""

from engine.cache.storage.health import BreakerSettings, StorageHealth


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_failures_in_a_row_open_then_a_probe_closes():
    clock = Clock()
    health = StorageHealth(BreakerSettings(failures=2, latency_s=1.0, open_s=1.0), clock=clock)
    assert health.allow()
    health.record(False, 0.01)
    health.record(True, 0.01)  # a success resets the run
    health.record(False, 0.01)
    assert health.state == "closed"
    health.record(False, 0.01, "exists: rc=-900")
    assert health.state == "open" and not health.allow()
    clock.now += 1.0
    assert health.allow() and health.state == "half_open"
    assert not health.allow()  # one probe at a time
    health.record(True, 0.01)
    snap = health.snapshot()
    assert snap.state == "closed" and snap.transitions == {"closed": 1, "half_open": 1, "open": 1}
    assert snap.short_circuited == 2 and snap.last_failure == "exists: rc=-900"


def test_slow_calls_count_as_failures_and_a_failed_probe_doubles_the_window():
    clock = Clock()
    health = StorageHealth(BreakerSettings(failures=1, latency_s=0.5, open_s=1.0), clock=clock)
    health.record(True, 0.6)  # slower than latency_s
    assert health.state == "open" and "took 0.60 s" in health.snapshot().last_failure
    clock.now += 1.0
    assert health.allow()
    health.record(False, 0.01)
    clock.now += 1.5
    assert not health.allow(), "reopened for 2 s"
    clock.now += 0.5
    assert health.allow()


def test_dropped_backups_are_counted():
    health = StorageHealth()
    health.drop_backup(3)
    health.drop_backup(2)
    assert health.snapshot().dropped_backup_pages == 5


def test_skipping_while_open_leaves_the_probe_to_the_next_call():
    clock = Clock()
    health = StorageHealth(BreakerSettings(failures=1, open_s=1.0), clock=clock)
    assert not health.skipping()  # closed
    health.record(False, 0.01)
    assert health.skipping() and health.state == "open"
    clock.now += 1.0
    assert not health.skipping() and health.state == "open"  # a probe is due: not started by skipping
    assert health.allow() and health.state == "half_open"
    assert health.snapshot().short_circuited == 1


def test_backups_ramp_up_after_a_recovery_and_not_before_one():
    """A store that just came back gets 10% of the backup pages at first, rising linearly to all of them
    over ramp_s; a breaker that never opened admits everything."""
    clock = Clock()
    health = StorageHealth(BreakerSettings(failures=1, open_s=1.0, ramp_s=10.0), clock=clock)
    assert all(health.admit_backup(4) for _ in range(20)) and health.snapshot().ramp_share is None
    health.record(False, 0.01)
    clock.now += 1.0
    assert health.allow()
    health.record(True, 0.01)  # the probe closes it: the ramp starts
    assert health.snapshot().ramp_share == 0.1
    admitted = sum(health.admit_backup(1) for _ in range(100))
    assert admitted == 10
    clock.now += 5.0  # halfway: 55%
    assert abs(health.snapshot().ramp_share - 0.55) < 1e-9
    assert 54 <= sum(health.admit_backup(1) for _ in range(100)) <= 56
    clock.now += 5.0  # over: everything again
    assert all(health.admit_backup(8) for _ in range(10)) and health.snapshot().ramp_share is None


def test_a_zero_ramp_resumes_backups_at_once():
    clock = Clock()
    health = StorageHealth(BreakerSettings(failures=1, open_s=1.0, ramp_s=0), clock=clock)
    health.record(False, 0.01)
    clock.now += 1.0
    assert health.allow()
    health.record(True, 0.01)
    assert all(health.admit_backup(1) for _ in range(10))


def test_the_ramp_share_is_a_metric_only_while_ramping():
    from engine.server.metrics import _breaker

    clock = Clock()
    health = StorageHealth(BreakerSettings(failures=1, open_s=1.0, ramp_s=10.0), clock=clock)

    def families():
        snap = {"storage_backend": "file", **vars(health.snapshot())}
        return {f.name: f for f in _breaker("m", snap)}

    assert "sglang:hicache_storage_backup_ramp_share" not in families()
    health.record(False, 0.01)
    clock.now += 1.0
    health.allow()
    health.record(True, 0.01)
    clock.now += 2.5
    (sample,) = families()["sglang:hicache_storage_backup_ramp_share"].samples
    assert abs(sample.value - 0.325) < 1e-9 and sample.labels["storage_backend"] == "file"
