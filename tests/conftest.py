"""Suite-wide pytest configuration and fixtures (area fixtures live in tests/<area>/conftest.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _model_testlib():
    """``tests/model/model_testlib.py`` loaded by path (the test folders are not packages)."""
    path = Path(__file__).resolve().parent / "model" / "model_testlib.py"
    spec = importlib.util.spec_from_file_location("suite_model_testlib", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer random Llama (vocab 320, 512 positions) with a BPE tokenizer and chat template, written
    once per session by transformers (seed 7)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    _model_testlib().save_tiny_model(folder, "llama", seed=7)
    return folder


@pytest.fixture(scope="session")
def tiny_mla_model_dir(tmp_path_factory) -> Path:
    """A 2-layer random DeepSeek-V3 (MLA: kv_lora_rank 32 + qk_rope_head_dim 16, dense layers) with the same
    tokenizer, written once per session by transformers (seed 7)."""
    folder = tmp_path_factory.mktemp("tiny-deepseek-v3")
    _model_testlib().save_tiny_model(folder, "deepseek_v3", seed=7)
    return folder


@pytest.fixture(scope="session")
def sglang_router_env() -> Path:
    """sglang-router 0.3.2's own venv (the router deployments that pin it run), built by
    scripts/sglang_router_env.sh on first use (~15 s from PyPI) and reused from its cache folder after
    (``${XDG_CACHE_HOME:-~/.cache}/kvfleet/``); its python. Fails the test when it cannot be built."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "scripts" / "sglang_router_env.sh"
    out = subprocess.run([str(script)], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        pytest.fail(f"scripts/sglang_router_env.sh failed:\n{out.stderr[-3000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def lmcache_server_binary() -> Path:
    """``lmcache_server`` from LMCache 0.5.6's own venv, built by scripts/lmcache_env.sh on first use (~3 min
    from PyPI) and reused from its cache folder after (``${XDG_CACHE_HOME:-~/.cache}/kvfleet/``). Skips the
    test, saying why, when that environment cannot be built (it needs PyPI the first time)."""
    from engine.fleet.lmcache_server import LMCacheServerError, build_env

    try:
        return build_env()
    except LMCacheServerError as exc:
        pytest.skip(f"LMCache's environment cannot be built here: {exc}")


@pytest.fixture(scope="session")
def lmcache_server(lmcache_server_binary):
    """A real ``lmcache_server`` (in-memory ``cpu`` store) on a free loopback port, one per test session
    (it takes seconds to start: it imports torch). Tests share it, so each writes keys of its own (its own
    namespace or tokens); the protocol has no delete."""
    from engine.fleet.lmcache_server import LMCacheServer

    with LMCacheServer(lmcache_server_binary) as server:
        yield server
