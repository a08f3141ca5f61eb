"""Whether a request's bootstrap address names this prefill's bootstrap server: ``OwnerCheck``.

A request whose ``bootstrap_host:bootstrap_port`` names another prefill was sent here as its *decode* (this
worker was one when the router picked it, then switched roles). An address that is this server's by name
(its host or a loopback name, and its port) passes at once; any other is asked for its ``start_id`` on a
pool thread (``contact.foreign``): this server's under another name passes (and is remembered), another
prefill's or nothing listening there is the room's failure (a decision that differs from upstream:
docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from engine.disaggregation import contact
from engine.disaggregation.common import names_this_host
from engine.disaggregation.sender import KVSender


class OwnerCheck:
    """Checks addresses against the bootstrap server ``host:port`` whose instance is ``start_id``;
    ``on_foreign(sender, reason, endpoint)`` runs on the pool thread for a room whose address is not it
    (``endpoint``: the side channel of the prefill there, to abort the room at, or None)."""

    def __init__(
        self, host: str, port: int, start_id: str, on_foreign: Callable[[KVSender, str, str | None], None]
    ) -> None:
        self.host, self.port, self.start_id = host, port, start_id
        self.address = f"{host}:{port}"
        self._on_foreign = on_foreign
        self._aliases: set[str] = set()  # other addresses found to name this bootstrap server
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pd-prefill-owner")

    def names_me(self, address: str) -> bool:
        host, _, port = address.rpartition(":")
        if address in self._aliases:
            return True
        return port == str(self.port) and names_this_host(host, self.host)

    def check(self, sender: KVSender, address: str) -> None:
        """Unless ``address`` names this server by name, check it on the pool thread. Never blocks."""
        if not self.names_me(address):
            self._pool.submit(self._check, sender, address)

    def _check(self, sender: KVSender, address: str) -> None:
        reason, endpoint, alias = contact.foreign(address, self.address, self.start_id)
        if alias:
            self._aliases.add(address)
        if reason is not None:
            self._on_foreign(sender, reason, endpoint)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
