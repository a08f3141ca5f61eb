"""``PeerSessions``: one model of a PD peer (register, bind rooms, probe, restart by start id, gone)."""

from __future__ import annotations

import time

from engine.disaggregation.peers import Peer, PeerHooks, PeerSessions


class Owner:
    """Records what the sessions ask of their owner."""

    def __init__(self) -> None:
        self.gone: list[tuple[str, set[int], str]] = []
        self.restarts: list[tuple[str, str | None, str]] = []
        self.probes: list[str] = []

    def hooks(self, probe: bool = True) -> PeerHooks:
        return PeerHooks(
            on_gone=lambda peer, rooms, reason: self.gone.append((peer.key, rooms, reason)),
            on_restart=lambda peer, new: self.restarts.append((peer.key, peer.start_id, new)),
            probe=(lambda peer: self.probes.append(peer.key)) if probe else None,
        )


def test_a_gone_peer_fails_every_room_bound_to_it_once():
    owner = Owner()
    peers = PeerSessions(owner.hooks(), probe_interval_s=1.0, dead_after_s=3.0)
    peers.add("d1:1", "s1", room=10)
    peers.bind("d1:1", 11)
    peers.add("d2:2", "s2", room=12)
    peers.bind("d1:1", 13)
    peers.unbind("d1:1", 13)  # closed
    assert peers.bound(11) == ["d1:1"] and peers.has_rooms("d1:1")
    peer = peers.get("d1:1")
    assert peers.gone(peer, "killed")
    assert not peers.gone(peer, "again")
    assert owner.gone == [("d1:1", {10, 11}, "killed")]
    assert peers.get("d1:1") is None and peers.bind("d1:1", 14) is None  # forgotten (keep_gone off)
    assert peers.bound(12) == ["d2:2"]


def test_a_silent_peer_is_probed_then_gone_after_dead_after_s():
    owner = Owner()
    peers = PeerSessions(owner.hooks(), probe_interval_s=1.0, dead_after_s=3.0, keep_gone=True)
    peer, created = peers.add("d:1", "s", room=7)
    assert created and peers.add("d:1")[0] is peer and not peers.add("d:1")[1]
    start = peer.probed_at  # the probe clock starts with the session (its silence clock no later)
    peers.tick(start + 0.5, lambda p: "silent")
    assert owner.probes == []
    peers.tick(start + 1.0, lambda p: "silent")
    peers.tick(start + 1.5, lambda p: "silent")
    assert owner.probes == ["d:1"]  # once per interval
    peers.tick(start + 2.0, lambda p: "silent")
    assert owner.probes == ["d:1", "d:1"] and owner.gone == []
    peers.tick(start + 3.2, lambda p: f"{p.key} silent")
    assert owner.gone == [("d:1", {7}, "d:1 silent")]
    assert peers.get("d:1") is None and peers.gone_keys() == ["d:1"]
    assert peers.all_gone_since is not None  # kept listed: every peer met is gone


def test_an_answer_keeps_a_peer_alive_and_brings_a_gone_one_back():
    owner = Owner()
    peers = PeerSessions(owner.hooks(), probe_interval_s=1.0, dead_after_s=3.0, keep_gone=True)
    peer, _ = peers.add("d:1", "s")
    peers.add("d:2", "t")
    for _ in range(3):
        time.sleep(0.01)
        assert peers.heard("d:1", "s")
    peers.tick(peer.heard_at + 2.0, lambda p: "silent")
    assert owner.gone == []
    peers.gone(peer, "lost")
    assert peers.all_gone_since is None  # d:2 lives
    assert peers.heard("d:1")  # it spoke again: the same instance is back, with no rooms
    assert peers.get("d:1") is peer and not peer.rooms and peers.gone_keys() == []


def test_a_new_start_id_is_a_restart_and_leaves_the_old_session_to_the_owner():
    owner = Owner()
    peers = PeerSessions(owner.hooks(), probe_interval_s=1.0, dead_after_s=3.0)
    peer, _ = peers.add("p:1", "old", room=3)
    assert not peers.heard("p:1", "new")
    assert owner.restarts == [("p:1", "old", "new")]
    assert peers.get("p:1") is peer and peer.start_id == "old"  # the owner decides (e.g. ``replace``)
    fresh = Peer("p:1", "new")
    assert peers.replace(peer, fresh) and not peers.replace(peer, None)
    assert peers.get("p:1") is fresh
    assert peers.heard("p:1") and not peers.heard("unknown:1")


def test_synchronous_probes_count_misses_until_an_answer():
    owner = Owner()
    peers = PeerSessions(owner.hooks(probe=False), probe_interval_s=5.0, dead_after_s=None)
    peer, _ = peers.add("p:1", "s")
    assert peers.missed(peer) == 1 and peers.missed(peer) == 2
    peers.answered(peer)
    assert peers.missed(peer) == 1
    peers.tick(time.monotonic() + 3600, lambda p: "silent")  # no silence rule: the owner counts misses
    assert owner.gone == [] and owner.probes == []


def test_info_stays_readable_after_the_peer_is_gone():
    owner = Owner()
    peers = PeerSessions(owner.hooks(), probe_interval_s=1.0, dead_after_s=3.0, keep_gone=True)
    peer, _ = peers.add("d:1", "s", info={"layout": 1})
    peers.gone(peer, "lost")
    assert peers.info("d:1") == {"layout": 1} and peers.info("d:9") is None
