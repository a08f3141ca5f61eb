"""The inputs of the LMCache policy anchor: the shared-prefix multi-turn trace is a valid, prefix-closed
Mooncake trace, and scripts/lmcache_policies.py keys its chunks exactly as the what-if keys its pages (so
both tools replay the same chunk sequence; the script imports LMCache only inside its drivers)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from engine.bench.multiturn_trace import BLOCK, generate
from engine.whatif.replay import Capacities, replay_trace
from engine.whatif.trace import load_trace, page_keys

ROOT = Path(__file__).resolve().parents[2]


def _runner():
    spec = importlib.util.spec_from_file_location(
        "lmcache_policies", ROOT / "scripts" / "lmcache_policies.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(tmp_path: Path, sessions: int = 40) -> Path:
    reqs = generate(sessions, system_prompts=4, minutes=2, seed=3)
    path = tmp_path / "multiturn_trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    return path


def test_multiturn_trace_is_deterministic_and_prefix_closed(tmp_path):
    assert generate(40, 4, 2, 3) == generate(40, 4, 2, 3)
    reqs = load_trace(_write(tmp_path), BLOCK)  # parses with the engine's checks (lengths vs ids)
    assert [r.timestamp for r in reqs] == sorted(r.timestamp for r in reqs)
    seen: dict[int, tuple[int, int | None]] = {}
    for r in reqs:
        for k, h in enumerate(r.hash_ids):  # an id always has the same position and predecessor
            assert seen.setdefault(h, (k, r.hash_ids[k - 1] if k else None)) == (
                k,
                r.hash_ids[k - 1] if k else None,
            )
    shared = {h for r in reqs for h in r.hash_ids[:2]}
    assert len(shared) < len(reqs) / 4  # sessions share their system prompt's leading blocks


def test_multiturn_trace_reuses_prefixes(tmp_path):
    reqs = load_trace(_write(tmp_path), BLOCK)
    c = replay_trace(reqs, Capacities(float("inf")), block_tokens=BLOCK, page_size=64)
    assert c.served_l1 / c.input_tokens > 0.5  # later turns extend earlier ones


def test_runner_chunk_keys_are_the_whatif_page_keys(tmp_path):
    path = _write(tmp_path, sessions=10)
    runner = _runner()
    for chunk in (64, 512):
        got = runner.load_requests(path, BLOCK, chunk)
        want = load_trace(path, BLOCK)
        assert [n for n, _ in got] == [r.input_length for r in want]
        assert [keys for _, keys in got] == [page_keys(r, r.input_length, BLOCK, chunk) for r in want]
