"""The client side of a prefill's bootstrap server (``bootstrap.py``): what the transfers ask it over HTTP.

P's ranks register their side-channel endpoints (``register_rank``) and P checks whether a request's
bootstrap address is another prefill's (``foreign``); D's first contact with a prefill reads its info,
checks it against D's pool and looks up the ranks D receives from (``first_contact``). All calls block
(pool or start-up threads only, never the scheduler thread).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from threading import Event

import httpx

from engine.disaggregation.base import KVLayout, TransferTimeouts
from engine.disaggregation.bootstrap import START_ID_HEADER
from engine.disaggregation.heads import HeadShare, head_shares, sources

INFO_QUERY = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
BOOTSTRAP_HTTP_TIMEOUT = httpx.Timeout(3.0, connect=2.0)  # upstream's heartbeat: connect 2 s, read 3 s
REGISTER_TRIES = 5  # upstream: 5 tries, exponential backoff from 1 s, up to 30 s, with jitter


class ContactError(RuntimeError):
    """First contact with a prefill failed; the message is the rooms' failure reason."""


def rank_query(tp_rank: int = 0) -> str:
    """The ``GET /route`` query for prefill tensor-parallel rank ``tp_rank`` (dp, cp and pp rank 0)."""
    return f"prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank={tp_rank}&target_pp_rank=0"


def rank_endpoint(client: httpx.Client, address: str, tp_rank: int = 0) -> tuple[str, str | None]:
    """(side-channel endpoint ``ip:port``, bootstrap ``start_id``) of tensor-parallel rank ``tp_rank`` of
    the prefill whose bootstrap server is at ``address``. Raises ``httpx.HTTPError`` or ``ValueError``
    (a bad answer)."""
    response = client.get(f"http://{address}/route?{rank_query(tp_rank)}")
    response.raise_for_status()
    rank = response.json()
    return f"{rank['rank_ip']}:{rank['rank_port']}", rank.get("start_id")


def register_rank(
    address: str, endpoint: str, layout: KVLayout, tp_rank: int, tp_size: int, http_port: int | None
) -> str | None:
    """PUT a prefill rank's side-channel ``endpoint`` to the bootstrap server at ``address`` (retried with
    backoff); a rank other than 0 then reads the server's ``start_id`` and returns it (rank 0 owns the
    server: None). Raises ``OSError`` after the last try."""
    ep_host, ep_port = endpoint.rsplit(":", 1)
    body = {
        "rank_ip": ep_host,
        "rank_port": int(ep_port),
        "attn_tp_size": tp_size,
        "attn_tp_rank": tp_rank,
        "attn_cp_size": 1,
        "attn_cp_rank": 0,
        "attn_dp_size": 1,
        "attn_dp_rank": 0,
        "pp_size": 1,
        "pp_rank": 0,
        "system_dp_size": 1,
        "system_dp_rank": 0,
        "page_size": layout.page_size,
        "kv_cache_dtype": layout.kv_cache_dtype,
        "load_balance_method": "follow_bootstrap_room",
        "prefill_http_port": http_port,
    }
    url = f"http://{address}/route"
    for attempt in range(REGISTER_TRIES):
        try:
            httpx.put(url, json=body, timeout=5.0).raise_for_status()
            if tp_rank == 0:
                return None
            health = httpx.get(f"http://{address}/health", timeout=5.0)
            return health.raise_for_status().headers[START_ID_HEADER]
        except (httpx.HTTPError, KeyError) as exc:
            if attempt == REGISTER_TRIES - 1:
                raise OSError(f"cannot register with the bootstrap server {url}: {exc!r}") from exc
            time.sleep(min(30.0, 2**attempt) * random.uniform(0.8, 1.2))  # backoff between retries
    raise AssertionError("unreachable")


def foreign(address: str, mine: str, start_id: str) -> tuple[str | None, str | None, bool]:
    """(why a request naming ``address`` cannot pair with the prefill at ``mine`` whose server has
    ``start_id``, the side-channel endpoint of the prefill at ``address`` or None, whether ``address`` is
    ``mine`` under another name). (None, None, False) when the server there gives no verdict (then the
    bootstrap timeout applies)."""
    try:
        with httpx.Client(timeout=BOOTSTRAP_HTTP_TIMEOUT) as client:
            response = client.get(f"http://{address}/route?{INFO_QUERY}")
            if response.status_code != 200:
                return None, None, False
            if response.json().get("start_id") == start_id:
                return None, None, True
            reason = (
                f"bootstrap {address} is another prefill, not this one ({mine}): "
                "the request was sent here as its decode, and this worker is a prefill now"
            )
            try:
                return reason, rank_endpoint(client, address)[0], False
            except (httpx.HTTPError, ValueError, KeyError):
                return reason, None, False
    except httpx.ConnectError:
        why = f"no prefill bootstrap server at {address} (connection refused)"
        return f"{why}; this worker's is {mine}", None, False
    except (httpx.HTTPError, ValueError):
        return None, None, False


def current_start_id(client: httpx.Client, address: str) -> str | None:
    """The ``start_id`` the bootstrap server at ``address`` answers now (None: no verdict, e.g. a slow or
    starting prefill). Raises ``httpx.ConnectError`` when nothing listens there."""
    try:
        response = client.get(f"http://{address}/route?{INFO_QUERY}")
        return response.json().get("start_id") if response.status_code == 200 else None
    except httpx.ConnectError:
        raise
    except (httpx.HTTPError, ValueError):
        return None


def health(client: httpx.Client, address: str) -> tuple[bool, str | None]:
    """(whether the prefill at ``address`` answered ``/health`` 200, its ``start_id``): D's heartbeat."""
    try:
        response = client.get(f"http://{address}/health")
        return response.status_code == 200, response.headers.get(START_ID_HEADER)
    except httpx.HTTPError:
        return False, None


@dataclass
class PrefillRanks:
    """What D's first contact found out about a prefill instance: the side-channel ``endpoints`` of the
    prefill ranks this decode rank receives from (prefill rank -> endpoint), what each sends (``shares``,
    None when both sides have the same tp: whole pages from the same rank), how many decode ranks each of
    them sends to (``required``) and the server's ``start_id``."""

    endpoints: dict[int, str]
    shares: dict[int, HeadShare] | None
    required: dict[int, int]
    start_id: str | None


def first_contact(
    client: httpx.Client,
    address: str,
    layout: KVLayout,
    timeouts: TransferTimeouts,
    tp_rank: int,
    tp_size: int,
    model_kv_heads: int,
    stop: Event,
) -> PrefillRanks:
    """Read the prefill's info (``GET /route``, 503 until its ranks registered: retried), check page size,
    KV dtype and the tp pairing, and look up the ranks this decode rank receives from. ``ContactError``."""
    tries = timeouts.bootstrap_query_retries
    last = "no answer"
    for attempt in range(tries):
        if attempt and stop.wait(timeouts.bootstrap_query_interval_s):
            raise ContactError("decode is shutting down")
        try:
            response = client.get(f"http://{address}/route?{INFO_QUERY}")
        except httpx.HTTPError as exc:
            last = str(exc) or type(exc).__name__
            continue
        if response.status_code == 503:
            last = "prefill ranks not all registered (503)"
            continue
        if response.status_code != 200:
            raise ContactError(f"prefill bootstrap {address} answered {response.status_code} to GET /route")
        info = response.json()
        break
    else:
        raise ContactError(f"prefill bootstrap {address} unreachable after {tries} tries: {last}")
    for name, mine in (("page_size", layout.page_size), ("kv_cache_dtype", layout.kv_cache_dtype)):
        if info.get(name) != mine:
            raise ContactError(f"{name} mismatch: prefill {address} has {info.get(name)}, decode has {mine}")
    p_tp, start_id = int(info.get("attn_tp_size", 1)), info.get("start_id")
    if p_tp == tp_size:
        ranks, shares, required = [tp_rank], None, {tp_rank: 1}
    else:
        try:
            everyone = head_shares(model_kv_heads, p_tp, tp_size)
        except ValueError as exc:
            raise ContactError(f"prefill {address} at tp {p_tp}, decode at tp {tp_size}: {exc}") from None
        mine_ = sources(model_kv_heads, p_tp, tp_size, tp_rank)
        ranks, shares = [s.p for s in mine_], {s.p: s for s in mine_}
        required = {p: sum(s.p == p for s in everyone) for p in ranks}
    endpoints = {}
    for p in ranks:
        try:
            endpoints[p], rank_start = rank_endpoint(client, address, p)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            raise ContactError(f"prefill bootstrap {address}: lookup of rank {p} failed: {exc}") from exc
        if rank_start != start_id:
            raise ContactError(f"prefill bootstrap {address} restarted during first contact")
    return PrefillRanks(endpoints, shares, required, start_id)
