"""Fixtures for engine server tests: a tiny random Llama on disk, in-process engines, HTTP servers."""

from __future__ import annotations

import httpx
import pytest
import torch
from server_testlib import ThreadedServer

from engine.model.runner import ModelRunner
from engine.server.args import parse_args
from engine.server.builder import build_engine


@pytest.fixture(scope="session")
def tiny_runner(tiny_model_dir) -> ModelRunner:
    return ModelRunner(tiny_model_dir, dtype="float32", device="cpu")


@pytest.fixture
def make_engine(tiny_model_dir, tiny_runner):
    """``make_engine(*flags, model=None)`` -> a started Engine on the tiny model, or on ``model``, a
    ``(folder, ModelRunner)`` pair (stopped at teardown)."""
    engines = []

    def make(*flags: str, model: tuple | None = None):
        folder, runner = model or (tiny_model_dir, tiny_runner)
        args = parse_args(["--model-path", str(folder), *flags])
        engine = build_engine(args, runner=runner)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()  # every DP rank's scheduler


@pytest.fixture
def serve(make_engine):
    """``serve(*flags, model=None)`` -> (ThreadedServer, httpx.Client) on a fresh engine (``make_engine``)."""
    stack = []

    def start(*flags: str, model: tuple | None = None):
        server = ThreadedServer(make_engine(*flags, model=model)).__enter__()
        client = httpx.Client(base_url=server.url, timeout=60)
        stack.append((server, client))
        return server, client

    yield start
    for server, client in stack:
        client.close()
        server.__exit__(None, None, None)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
