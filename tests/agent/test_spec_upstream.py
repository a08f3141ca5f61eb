"""Fleet spec, upstream SGLang workers (``engine = "sglang"``): flag names are checked against the real
SGLang of the spec's ``python`` (its own parser, asked once per interpreter), KVFleet-only flags are refused
naming them, secrets go to the environment and never into the command line."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from engine.agent.agent import command
from engine.agent.engines import SGLANG_BOOTSTRAP, EngineUnavailable, upstream_flags
from engine.agent.spec import SpecError, load_spec, with_role
from tests.support.sglang_upstream import sglang_python


def spec(tmp_path, body: str):
    path = tmp_path / "fleet.toml"
    path.write_text(textwrap.dedent(body))
    return path


def upstream(tmp_path, extra: str = "", python: str | None = None):
    py = python or sglang_python()
    return spec(
        tmp_path,
        f"""\
        [[workers]]
        name = "up0"
        engine = "sglang"
        python = "{py}"
        model = "/models/smollm2"
        port = 31100
        page_size = 16
        enable_hierarchical_cache = true
        hicache_ratio = 2
        attention_backend = "torch_native"
        admin_api_key = "${{ADMIN_KEY}}"
        """
        + textwrap.dedent(extra),
    )


def test_an_upstream_worker_becomes_upstreams_own_flags(tmp_path):
    w = load_spec(upstream(tmp_path), {"ADMIN_KEY": "s3cret-admin"}).workers[0]
    assert (w.engine, w.engine_version) == ("sglang", upstream_flags(sglang_python()).version)
    assert w.engine_version == "0.5.23"
    assert w.flags == [
        "--model-path=/models/smollm2",
        "--port=31100",
        "--page-size=16",
        "--enable-hierarchical-cache",
        "--hicache-ratio=2",
        "--attention-backend=torch_native",
    ]
    assert (w.port, w.page_size, w.host, w.url) == (31100, 16, "127.0.0.1", "http://127.0.0.1:31100")
    assert w.env == {"KVFLEET_ADMIN_API_KEY": "s3cret-admin"} and w.admin_api_key == "s3cret-admin"
    argv = command(w)
    assert argv[:3] == [sglang_python(), "-c", SGLANG_BOOTSTRAP] and argv[3:] == w.flags
    assert not any("s3cret" in a for a in argv)


def test_the_bootstrap_hands_the_key_to_upstream_without_a_command_line(tmp_path):
    """The bootstrap really moves the keys into upstream's argv (here: a stand-in ``sglang.launch_server``
    module on the path that prints its argv and its own command line)."""
    pkg = tmp_path / "sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(
        "import os, sys\nprint(sys.argv[1:])\nprint(open(f'/proc/{os.getpid()}/cmdline').read())\n"
    )
    env = {"PYTHONPATH": str(tmp_path), "KVFLEET_ADMIN_API_KEY": "adm-1", "KVFLEET_API_KEY": "api-2"}
    out = subprocess.run(
        [sys.executable, "-c", SGLANG_BOOTSTRAP, "--port=1"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out[0] == "['--port=1', '--admin-api-key', 'adm-1', '--api-key', 'api-2']"
    assert "adm-1" not in out[1] and "api-2" not in out[1]


def test_a_worker_without_keys_runs_the_plain_module(tmp_path):
    path = upstream(tmp_path)
    path.write_text(path.read_text().replace('admin_api_key = "${ADMIN_KEY}"\n', ""))
    w = load_spec(path, {}).workers[0]
    assert command(w)[:3] == [sglang_python(), "-m", "sglang.launch_server"]


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        (
            "record_trace = true",
            "workers[0].record_trace",
            "--record-trace is KVFleet's own flag: SGLang 0.5.23",
        ),
        ("tenant_keys_file = 'x.json'", "workers[0].tenant_keys_file", "--tenant-keys-file is KVFleet's own"),
        ("hicache_ratoi = 2", "workers[0].hicache_ratoi", "did you mean 'hicache_ratio'?"),
        ("engine_x = 1", "workers[0].engine_x", "not a launch flag of SGLang 0.5.23"),
        ("enable_metrics = 'yes'", "workers[0].enable_metrics", "must be true or false"),
    ],
)
def test_a_bad_upstream_key_names_the_field_and_the_reason(tmp_path, extra, field, words):
    with pytest.raises(SpecError) as exc:
        load_spec(upstream(tmp_path, extra), {"ADMIN_KEY": "k"})
    assert exc.value.field == field and words in exc.value.problem, str(exc.value)
    assert exc.value.line is not None


def test_the_python_field_is_required_and_checked(tmp_path):
    path = upstream(tmp_path, python="/nonexistent/bin/python")
    with pytest.raises(SpecError) as exc:
        load_spec(path, {"ADMIN_KEY": "k"})
    assert exc.value.field == "workers[0].python" and "/nonexistent/bin/python" in exc.value.problem
    # An interpreter without SGLang (the project's own) says so.
    with pytest.raises(EngineUnavailable, match="cannot import SGLang"):
        upstream_flags(sys.executable)
    path.write_text(path.read_text().replace('python = "/nonexistent/bin/python"\n', ""))
    with pytest.raises(SpecError, match='needs python = "<its SGLang environment>/bin/python"'):
        load_spec(path, {"ADMIN_KEY": "k"})


def test_python_and_an_unknown_engine_are_refused_elsewhere(tmp_path):
    kv = spec(tmp_path, '[[workers]]\nname = "a"\nmodel = "smollm2"\nport = 1\npython = "/usr/bin/python3"\n')
    with pytest.raises(SpecError, match='only an engine = "sglang" worker names its python'):
        load_spec(kv, {})
    bad = spec(tmp_path, '[[workers]]\nname = "a"\nmodel = "smollm2"\nport = 1\nengine = "vllm"\n')
    with pytest.raises(SpecError, match="must be one of kvfleet, sglang, got 'vllm'"):
        load_spec(bad, {})


def test_with_role_restarts_an_upstream_worker_in_the_other_mode(tmp_path):
    w = load_spec(upstream(tmp_path, 'disaggregation_mode = "prefill"'), {"ADMIN_KEY": "k"}).workers[0]
    assert w.role == "prefill" and "--disaggregation-mode=prefill" in w.flags
    d = with_role(w, "decode")
    assert d.role == "decode" and "--disaggregation-mode=decode" in d.flags and d.engine == "sglang"
    assert "--disaggregation-mode=prefill" not in d.flags
