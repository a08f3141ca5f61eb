"""``kvfleet-agent check-isolation URL`` against real worker processes: a worker that keeps salts apart
passes (exit 0, both TTFTs printed), one whose prefix cache cannot reuse the prompt fails (exit 1, says
why), a tenant-keyed worker is checked with a tenant's key, and a wrong key is a one-line error. Through a
real smg (1.13.0) with one worker the check holds on every salt route; with two it is inconclusive, never
"ok"; through sglang-router 0.3.2 (its own venv) it fails loudly on /generate and chat, naming the router and
the supported way."""

from __future__ import annotations

import json

import pytest

from engine.agent.cli import main
from engine.bench.launcher import ServerProcess
from engine.fleet.router import RouterProcess, worker_args

pytestmark = pytest.mark.slow
WORDS = "48"  # the tiny model has 512 positions


@pytest.fixture(scope="module")
def tenant_worker(tiny_model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "tenants.json"
    keys.write_text(json.dumps({"tenants": {"ops": {"api_keys": ["sk-ops-check"]}}}))
    flags = ["--model-path", str(tiny_model_dir), "--page-size", "16", "--tenant-keys-file", str(keys),
             "--enable-cache-report"]  # fmt: skip
    with ServerProcess(flags) as worker:
        yield worker


def test_an_isolated_worker_passes_and_reports_both_ttfts(tenant_worker, tmp_path, capsys):
    key = tmp_path / "key"
    key.write_text("sk-ops-check\n")
    assert main(["check-isolation", tenant_worker.url, "--api-key-file", str(key), "--words", WORDS]) == 0
    out = capsys.readouterr().out
    rows = {line[:15].strip(): line for line in out.splitlines() if " cached " in line}
    assert "isolation: ok" in out
    assert rows["salt B"].endswith("cached device=0 host=0 storage=0")
    assert "cached device=0 " not in rows["salt A (again)"]
    assert all("ttft" in row for row in rows.values()) and "salt B / salt A (again) TTFT:" in out
    assert main(["check-isolation", tenant_worker.url, "--api-key", "sk-ops-check", "--words", WORDS,
                 "--json"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    cold, other, again = report["probes"]
    assert report["ok"] and sum(other["cached"].values()) == 0 and again["cached"]["device"] > 0
    assert cold["output_ids"] == other["output_ids"] == again["output_ids"]
    assert all(p["ttft_s"] > 0 for p in report["probes"])


def test_a_wrong_key_is_a_one_line_error(tenant_worker, capsys):
    assert main(["check-isolation", tenant_worker.url, "--api-key", "sk-wrong", "--words", WORDS]) == 1
    err = capsys.readouterr().err
    assert "answered 401" in err and "sk-wrong" not in err


def test_a_worker_that_cannot_reuse_the_prompt_fails_the_check(tiny_model_dir, capsys):
    # pages larger than the prompt: nothing is ever cached, so "same salt -> reuse" cannot hold
    with ServerProcess(["--model-path", str(tiny_model_dir), "--page-size", "256"]) as worker:
        assert main(["check-isolation", worker.url, "--words", "32"]) == 1  # about 200 tokens < 1 page
    out = capsys.readouterr().out
    assert "isolation: FAILED" in out and "second request reused nothing" in out


def test_too_few_words_names_the_flag(capsys):
    assert main(["check-isolation", "http://127.0.0.1:9", "--words", "5"]) == 2
    assert "--words must be >= 32" in capsys.readouterr().err


def test_through_smg_with_one_worker_the_salts_stay_apart_on_every_route(tenant_worker, capsys):
    with RouterProcess(worker_args([tenant_worker.url]), min_workers=1) as router:
        assert main(["check-isolation", router.url, "--api-key", "sk-ops-check", "--words", WORDS]) == 0
    out = capsys.readouterr().out
    rows = {line[:15].strip(): line for line in out.splitlines() if " cached " in line}
    assert "via smg 1.13.0 with 1 worker(s) listed" in out and "isolation: ok" in out
    assert rows["salt B"].endswith("cached device=0 host=0 storage=0")
    assert "cached device=0 " not in rows["salt A (again)"]
    for route in ("/generate", "/v1/completions", "/v1/chat/completions"):
        (line,) = [row for row in out.splitlines() if row.strip().startswith(route + " ")]
        assert line.endswith("salts apart") and " salt B cached     0 " in line


def test_through_sglang_router_0_3_2_the_salt_leak_fails_loudly(tenant_worker, sglang_router_env, capsys):
    with RouterProcess(worker_args([tenant_worker.url]), min_workers=1, kind="sglang-router") as router:
        args = ["check-isolation", router.url, "--api-key", "sk-ops-check", "--words", WORDS]
        assert main(args) == 1
        assert main([*args, "--json"]) == 1
    out, report = capsys.readouterr().out.split("\n{", 1)
    report = json.loads("{" + report)
    assert "via sglang-router (version not reported) with 1 worker(s) listed" in out
    assert "isolation: FAILED" in out
    assert {route: r["isolated"] for route, r in report["routes"].items()} == {
        "/generate": False,
        "/v1/completions": True,
        "/v1/chat/completions": False,
    }
    leaks = [p for p in report["problems"] if "salt B reused" in p]
    assert [p.split(":", 1)[0] for p in leaks] == ["/generate", "/v1/chat/completions"]
    assert all("which drops cache_salt there" in p and "--tenant-keys-file" in p for p in leaks)


def test_through_a_router_with_two_workers_no_reuse_is_inconclusive(tenant_worker, capsys):
    # one worker under two names: the router sees two, so "B reused nothing" proves nothing
    second = tenant_worker.url.replace("127.0.0.1", "localhost")
    with RouterProcess(worker_args([tenant_worker.url, second]), min_workers=2) as router:
        args = ["check-isolation", router.url, "--api-key", "sk-ops-check", "--words", WORDS, "--json"]
        assert main(args) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and report["inconclusive"] and report["router_workers"] == 2
    assert report["problems"][0].startswith("inconclusive: the router lists 2 workers")
    assert report["router"] == "smg 1.13.0" and set(report["routes"]) == {
        "/generate",
        "/v1/completions",
        "/v1/chat/completions",
    }
