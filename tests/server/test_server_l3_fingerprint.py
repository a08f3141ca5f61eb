"""An L3 page is served only to a worker whose KV comes from the same weights, quantization and compute
dtype: an int4wo worker and a bfloat16 worker of one checkpoint share a file L3 without a storage hit
across them; two bfloat16 workers hit each other's pages and give the same output."""

from __future__ import annotations

import json
import random

import pytest
from server_testlib import run_requests, wait_idle

from engine.model.loader import fingerprint
from engine.model.runner import ModelRunner
from engine.server.args import parse_args
from engine.server.builder import build_engine

PAGE = 16
NEW_TOKENS = 6


@pytest.fixture
def l3_worker(tiny_model_dir, tmp_path, monkeypatch):
    """``l3_worker(quantization)`` -> a started bfloat16 engine on the tiny model, file L3 in tmp_path."""
    monkeypatch.setenv(fingerprint.CACHE_ENV, str(tmp_path / "digests"))
    extra = json.dumps({"file_path": str(tmp_path / "l3"), "prefetch_threshold": PAGE})
    engines = []

    def start(quantization: str | None):
        runner = ModelRunner(tiny_model_dir, dtype="bfloat16", device="cpu", quantization=quantization)
        args = parse_args([
            "--model-path", str(tiny_model_dir), "--dtype", "bfloat16", "--page-size", str(PAGE),
            "--max-total-tokens", "1024", "--enable-hierarchical-cache", "--hicache-ratio", "4",
            "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", extra,
            "--hicache-storage-prefetch-policy", "wait_complete",
            *(["--torchao-config", quantization] if quantization else []),
        ])  # fmt: skip
        engine = build_engine(args, runner=runner)
        engines.append(engine)
        return engine

    yield start
    for engine in engines:
        engine.scheduler.stop()


def _serve_once(engine, prompt):
    out = run_requests(engine, [prompt], max_new_tokens=NEW_TOKENS)[0]
    wait_idle(engine)  # write-through has backed the prompt's pages up to L3
    return out


def test_quantized_and_bf16_workers_never_share_l3_pages_two_bf16_workers_do(l3_worker):
    prompt = [random.Random(3).randrange(3, 300) for _ in range(130)]
    aligned = (len(prompt) - 1) // PAGE * PAGE

    writer = l3_worker(None)
    first = _serve_once(writer, prompt)
    assert first["meta"]["cached_tokens"] == 0
    writer.scheduler.stop()

    int4 = l3_worker("int4wo-32")
    quantized = _serve_once(int4, prompt)
    assert quantized["meta"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 0}
    int4.scheduler.stop()

    reader = l3_worker(None)
    again = _serve_once(reader, prompt)
    assert again["meta"]["cached_tokens_details"]["storage"] == aligned
    assert again["ids"] == first["ids"]
