"""``engine.bench.long_context_itl`` against a stand-in ``llama-server`` (a small HTTP server that checks its
flags and reports ``timings`` per cache type) and a stubbed KVFleet profile: the llama.cpp runs get the
cache type for K and V with flash attention on and a prompt of the context's length, and the table gives
every row's ratio to KVFleet's first variant and llama.cpp's ratio to its first cache type."""

from __future__ import annotations

import sys
import textwrap

import pytest

from engine.bench import long_context_itl
from engine.model.loader import resolve_model_path

FAKE_SERVER = """\
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    args = sys.argv[1:]
    flag = lambda name: args[args.index(name) + 1]
    cache = flag("--cache-type-k")
    assert flag("--cache-type-v") == cache and flag("-fa") == "on" and flag("-t") == "1", args
    context = int(flag("-c"))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.reply({"status": "ok"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            n = len(body["prompt"])
            assert n + body["n_predict"] <= context and body["ignore_eos"] and not body["cache_prompt"]
            ms = {"f16": 10.0, "q8_0": 8.0}[cache]
            self.reply({"timings": {"prompt_n": n, "predicted_n": body["n_predict"],
                                    "predicted_per_token_ms": ms}})

        def reply(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    HTTPServer(("127.0.0.1", int(flag("--port"))), Handler).serve_forever()
"""


@pytest.fixture
def fake_llama(tmp_path):
    script = tmp_path / "llama-server"
    script.write_text(f"#!{sys.executable}\n" + textwrap.dedent(FAKE_SERVER))
    script.chmod(0o755)
    return str(script)


def test_llama_itl_reads_the_servers_own_per_token_time(fake_llama):
    gguf = resolve_model_path("smollm2")
    assert long_context_itl.llama_itl(fake_llama, gguf, "q8_0", context=300, steps=8, threads=1) == 8.0
    assert long_context_itl.llama_itl(fake_llama, gguf, "f16", context=300, steps=8, threads=1) == 10.0


def test_a_llama_server_that_dies_is_reported_with_its_output(tmp_path):
    script = tmp_path / "llama-server"
    script.write_text("#!/bin/sh\necho 'unsupported cache type' >&2\nexit 3\n")
    script.chmod(0o755)
    with pytest.raises(RuntimeError, match="exited with 3: unsupported cache type"):
        long_context_itl.llama_itl(str(script), resolve_model_path("smollm2"), "q4_9", 100, 4, 1)


def test_main_alternates_the_engines_and_prints_ratios_to_the_first_variant(fake_llama, monkeypatch, capsys):
    profiles: list[list[str]] = []

    def fake_profile(tree, args):
        profiles.append(args)
        return {"bf16@1:kv=bfloat16": 20.0, "bf16@1:kv=int8": 15.0}

    monkeypatch.setattr(long_context_itl, "run_profile", fake_profile)
    monkeypatch.setenv("LLAMA_SERVER", fake_llama)
    argv = ["long_context_itl", "--context", "200", "--steps", "4", "--reps", "2", "--chunk", "64"]
    argv += ["--variants", "bf16@1:kv=bfloat16", "bf16@1:kv=int8"]
    monkeypatch.setattr(sys, "argv", argv)
    long_context_itl.main()
    assert len(profiles) == 2
    assert profiles[0][:8] == ["--batch", "1", "--context", "200", "--steps", "4", "--chunk", "64"]
    out = capsys.readouterr().out
    assert "repetition 1: load" in out and "bf16@1:kv=int8 15.00, llama.cpp" in out
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines()[-4:]}
    assert rows["bf16@1:kv=int8"].split()[1:5] == ["15.00", "15.00-15.00", "0.75", "(0.75-0.75)"]
    assert rows["llama.cpp f16 KV"].split()[3:] == [
        "10.00",
        "10.00-10.00",
        "0.50",
        "(0.50-0.50)",
        "1.00",
        "(1.00-1.00)",
    ]
    assert rows["llama.cpp q8_0 KV"].split()[-2:] == ["0.80", "(0.80-0.80)"]
