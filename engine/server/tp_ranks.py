"""The processes of a tensor-parallel worker: rank 0 (the server process) starts the others and watches them.

Each other rank is a spawned process that joins the group, loads its shard of the model, builds its own L1
(and L2/L3) pools for its KV heads and runs a follower scheduler (``engine/scheduler/tp_sync.py``): no HTTP,
no inbox, the work rank 0 broadcasts each iteration. A rank that dies takes the worker down: rank 0 logs
which rank exited and how, marks itself unhealthy (``/health`` answers 503), stops the other ranks, and its
own scheduler fails at its next collective, which fails the requests in flight and ends the server
(``engine.launch_server`` exits 3); a rank whose rank 0 is gone exits on its own.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.ports import free_port

if TYPE_CHECKING:
    from engine.scheduler import Scheduler

FollowerBuilder = Callable[[Any, int, str], "Scheduler"]
"""``(args, rank, method) -> Scheduler``: builds follower rank ``rank``'s stack (``build_follower``)."""

logger = logging.getLogger(__name__)

EXIT_RANK_DIED = 3  # as a scheduler death: the supervisor restarts the worker
GRACE_S = 10.0  # after a rank's death, how long rank 0's scheduler has to fail before the process exits


def init_method(dist_init_addr: str | None) -> str:
    """``tcp://host:port`` where the ranks meet: ``--dist-init-addr`` or a free loopback port."""
    if dist_init_addr:
        return f"tcp://{dist_init_addr}"
    return f"tcp://127.0.0.1:{free_port()}"


def cpu_threads(tp_size: int) -> int:
    """Torch threads per rank on the CPU: the cores shared out, at least one."""
    return max(1, (os.cpu_count() or 1) // tp_size)


@dataclass
class RankProcesses:
    """Ranks 1..tp-1 of this worker, started by ``start_ranks``."""

    procs: list[multiprocessing.process.BaseProcess]
    stopping: bool = False
    on_death: Callable[[str], None] | None = None  # set once the engine exists: mark it unhealthy
    _watch: threading.Thread | None = field(default=None, repr=False)

    def watch(self) -> None:
        """Start the thread that takes the worker down when a rank exits while not ``stopping``."""
        self._watch = threading.Thread(target=self._run_watch, name="tp-rank-watch", daemon=True)
        self._watch.start()

    def _run_watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self.stopping:
            return
        rank, proc = sentinels[ready[0]]  # type: ignore[index]
        proc.join(1)
        message = (
            f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}; "
            f"every rank takes part in each forward pass, so the worker goes down"
        )
        logger.error(message)
        self.stopping = True
        for other in self.procs:
            if other.is_alive():
                other.terminate()
        if self.on_death is None:  # still starting: nothing is served yet
            os._exit(EXIT_RANK_DIED)
        self.on_death(message)
        time.sleep(GRACE_S)  # rank 0's scheduler fails at its next collective and the server ends
        logger.error("worker did not stop within %.0fs of rank %d's death; exiting", GRACE_S, rank)
        os._exit(EXIT_RANK_DIED)

    def stop(self, timeout: float = 10.0) -> None:
        """Wait for the ranks to leave (rank 0's scheduler told them to stop), then end any still there."""
        self.stopping = True
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(2)


def start_ranks(args, method: str, build: FollowerBuilder) -> RankProcesses:
    """Spawn ranks 1..``args.tp_size``-1 (each runs ``rank_main`` with ``build``, a module-level function so
    that the spawned child can import it: the model stack loads in the child only) and watch them."""
    ctx = multiprocessing.get_context("spawn")
    procs: list[multiprocessing.process.BaseProcess] = [
        ctx.Process(target=rank_main, args=(args, rank, method, build), name=f"tp-rank-{rank}", daemon=True)
        for rank in range(1, args.tp_size)
    ]
    for proc in procs:
        proc.start()
    ranks = RankProcesses(procs)
    ranks.watch()
    return ranks


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(EXIT_RANK_DIED)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def rank_main(args, rank: int, method: str, build: FollowerBuilder) -> None:
    """A follower rank: join the group, build this rank's model shard, pools and cache (``build``), run the
    follower scheduler until rank 0 says stop (exit 0) or a collective fails (exit 3)."""
    logging.basicConfig(
        level=args.log_level.upper(), format=f"[%(asctime)s tp{rank} %(name)s] %(message)s", stream=sys.stderr
    )
    _exit_with_parent()
    try:
        scheduler = build(args, rank, method)
        scheduler.run()
    except BaseException:
        logger.exception("tensor-parallel rank %d failed", rank)
        os._exit(EXIT_RANK_DIED)
    os._exit(0)
