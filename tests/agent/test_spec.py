"""Fleet spec: a good spec becomes the exact launch flags; every bad spec names file, line and field, and the
``run`` command then starts nothing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.agent.agent import worker_record
from engine.agent.spec import SpecError, load_spec, with_flags, with_role
from engine.server.args import parse_args

REPO = Path(__file__).resolve().parents[2]

GOOD = """\
[agent]
host_name = "node-a"
address = "10.1.2.3"
log_dir = "{log_dir}"

[[workers]]
name = "w0"
model = "smollm2"
port = 31001
page_size = 16
enable_hierarchical_cache = true
hicache_ratio = 2.0
hicache_mem_layout = "page_first"
hicache_storage_backend = "mooncake"
hicache_storage_backend_extra_config = {{ master_server_address = "${{MC_ADDR}}", protocol = "tcp" }}
admin_api_key = "${{ADMIN_KEY:-dflt}}"

[[workers]]
name = "w1"
model = "smollm2"
role = "mixed"
port = 31002
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(textwrap.dedent(text))
    return path


def test_good_spec_gives_launch_flags_and_urls(tmp_path):
    spec = load_spec(write(tmp_path, GOOD.format(log_dir=tmp_path / "logs")), {"MC_ADDR": "127.0.0.1:5555"})
    assert spec.host_name == "node-a"
    assert [w.url for w in spec.workers] == ["http://10.1.2.3:31001", "http://10.1.2.3:31002"]
    w0 = spec.workers[0]
    assert w0.flags[0] == "--model-path=smollm2"
    assert "--hicache-mem-layout=page_first" in w0.flags
    (extra,) = [
        f.split("=", 1)[1] for f in w0.flags if f.startswith("--hicache-storage-backend-extra-config=")
    ]
    extra = json.loads(extra)
    assert extra == {"master_server_address": "127.0.0.1:5555", "protocol": "tcp"}
    assert w0.admin_api_key == "dflt" and w0.page_size == 16
    assert "--enable-hierarchical-cache" in w0.flags
    assert spec.workers[1].flags == ["--model-path=smollm2", "--port=31002"]
    assert spec.state_file == str(tmp_path / "logs" / "agent-state.json")


def test_a_grpc_worker_is_reached_over_http_on_its_sidecar(tmp_path):
    """gRPC on --port, its HTTP routes (what the agent probes and the control plane registers) on
    --smg-http-sidecar-port, by default --port + 1."""
    from engine.agent.agent import local_url

    text = (
        '[[workers]]\nname = "g0"\nmodel = "m"\nport = 31001\ngrpc_mode = true\n\n'
        '[[workers]]\nname = "g1"\nmodel = "m"\nport = 31005\ngrpc_mode = true\n'
        "smg_http_sidecar_port = 31009\n"
    )
    g0, g1 = load_spec(write(tmp_path, text)).workers
    assert (g0.port, g0.url, local_url(g0)) == (31001, "http://127.0.0.1:31002", "http://127.0.0.1:31002")
    assert (g1.port, g1.url, local_url(g1)) == (31005, "http://127.0.0.1:31009", "http://127.0.0.1:31009")
    assert "--grpc-mode" in g0.flags and "--port=31001" in g0.flags


def test_the_api_key_reaches_the_engine_by_environment_and_the_control_plane_by_register(tmp_path):
    text = '[[workers]]\nname = "w0"\nmodel = "smollm2"\nport = 31001\napi_key = "${KEY}"\n'
    (w0,) = load_spec(write(tmp_path, text), {"KEY": "k-123"}).workers
    assert not any("k-123" in flag for flag in w0.flags) and w0.env == {"KVFLEET_API_KEY": "k-123"}
    assert w0.api_key == "k-123" and worker_record(w0)["api_key"] == "k-123"
    assert "api_key" not in worker_record(
        load_spec(write(tmp_path, text.replace('api_key = "${KEY}"\n', ""))).workers[0]
    )


def test_values_starting_with_a_dash_reach_the_engine_unchanged(tmp_path, monkeypatch):
    text = (
        '[[workers]]\nname = "w0"\nmodel = "-odd-model"\nport = 31001\n'
        'admin_api_key = "${KVFLEET_WORKER_ADMIN_KEY}"\nserved_model_name = "--served"\n'
    )
    spec = load_spec(write(tmp_path, text), {"KVFLEET_WORKER_ADMIN_KEY": "-Zx3abc"})
    (w0,) = spec.workers
    assert w0.admin_api_key == "-Zx3abc" and w0.model_name == "--served"
    for var, value in w0.env.items():  # the worker's environment, as the supervisor starts it
        monkeypatch.setenv(var, value)
    args = parse_args(w0.flags)  # what `python -m engine.launch_server <flags>` reads back
    assert (args.admin_api_key, args.model_path, args.model_name) == ("-Zx3abc", "-odd-model", "--served")


BAD = [
    ("[[workers]]\nname = \"w0\"\nmodel = \"m\"\nport = 1\nhicache_ratio = \n", 5, "toml", "Invalid value"),
    ("[[workers]]\nname = \"w0\"\nmodel = \"m\"\nport = 1\nbogus_flag = 3\n", 5, "workers[0].bogus_flag",
     "unknown field"),
    ("[[workers]]\nname = \"w0\"\nmodel = \"m\"\nport = 1\nhicache_ration = 3\n", 5,
     "workers[0].hicache_ration", "unknown field; did you mean 'hicache_ratio'?"),
    ("[agent]\nheartbeat_interval = 3\n\n[[workers]]\nname = \"w0\"\nmodel = \"m\"\nport = 1\n", 2,
     "agent.heartbeat_interval", "unknown field; did you mean 'heartbeat_interval_s'?"),
    ("[[workers]]\nname = \"w0\"\nmodel = \"m\"\nport = 1\n\n[[workers]]\nname = \"w1\"\nmodel = \"m\"\n"
     "port = 2\nhicache_ratio = \"lots\"\n", 10, "workers[1].hicache_ratio", "invalid float value: 'lots'"),
    ("[[workers]]\nname = \"w0\"\nmodel = \"m\"\nrole = \"leader\"\nport = 1\n", 4, "workers[0].role",
     "must be one of mixed, prefill, decode"),
    ("[[workers]]\nname = \"w0\"\nmodel = \"m\"\nport = 1\nhicache_write_policy = \"sometimes\"\n", 5,
     "workers[0].hicache_write_policy", "invalid choice: 'sometimes'"),
    ("[[workers]]\nname = \"w0\"\nmodel = \"m\"\nport = 1\nenable_metrics = \"yes\"\n", 5,
     "workers[0].enable_metrics", "must be true or false"),
    ("[[workers]]\nname = \"w0\"\nmodel = \"m\"\nport = 1\n"
     "hicache_storage_backend_extra_config = { master_server_address = \"${NOPE_UNSET_VAR}\" }\n", 5,
     "workers[0].hicache_storage_backend_extra_config.master_server_address", "NOPE_UNSET_VAR is not set"),
    ("[[workers]]\nname = \"w0\"\nmodel = \"m\"\nport = 7\n\n[[workers]]\nname = \"w1\"\nmodel = \"m\"\n"
     "port = 7\n", 9, "workers[1].port", "port 7 is used by another worker"),
    ("[[workers]]\nname = \"w0\"\nmodel = \"m\"\nport = 7\ngrpc_mode = true\n\n[[workers]]\nname = \"w1\"\n"
     "model = \"m\"\nport = 8\n", 10, "workers[1].port", "port 8 is used by another worker"),  # w0's sidecar
    ("[agent]\nheartbeat_interval_s = -1\n\n[[workers]]\nname = \"w0\"\nmodel = \"m\"\nport = 1\n", 2,
     "agent.heartbeat_interval_s", "must be > 0"),
    ("[agent]\nlog_dir = \"x\"\n", None, "workers", "lists no [[workers]]"),
    ("[[workers]]\nname = \"w0\"\nport = 1\n", 1, "workers[0]", "missing required field 'model'"),
    ("[[workers]]\nname = \"w0\"\nmodel = \"m\"\nport = 1\n"
     "hicache_storage_backend = \"mooncake\"\n", 5, "workers[0].hicache_storage_backend",
     "--hicache-storage-backend needs --enable-hierarchical-cache"),
    ("[[workers]]\nname = \"w0\"\nmodel = \"m\"\nport = 1\nrole = \"decode\"\n"
     "disaggregation_mode = \"prefill\"\n", 6, "workers[0].disaggregation_mode",
     "contradicts role = 'decode'"),
    ("[[workers]]\nname = \"w0\"\nmodel = \"m\"\nport = 1\ndisaggregation_mode = \"encode\"\n", 5,
     "workers[0].disaggregation_mode", "must be null, prefill or decode"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "line", "field", "problem"), BAD)
def test_bad_spec_names_file_line_and_field(tmp_path, text, line, field, problem):
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_spec(path, {})
    err = info.value
    assert (err.path, err.line, err.field) == (str(path), line, field)
    assert problem in err.problem
    assert str(err).startswith(f"{path}:{line}: {field}: " if line else f"{path}: {field}: ")


def test_run_with_bad_spec_exits_2_and_starts_nothing(tmp_path):
    log_dir = tmp_path / "agent-logs"
    path = write(tmp_path, f'[agent]\nlog_dir = "{log_dir}"\n\n[[workers]]\nname = "w0"\nmodel = "smollm2"\n'
                           'port = 31001\n\n[[workers]]\nname = "w1"\nmodel = "smollm2"\nport = 31002\n'
                           'page_size = 0\n')  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "engine.agent", "run", "--control-plane", "http://127.0.0.1:9",
         "--token", "cp_x.y", "--spec", str(path)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert f"{path}:13: workers[1].page_size: argument --page-size: --page-size must be > 0" in done.stderr
    assert not log_dir.exists()  # no worker was launched, no state file written


def test_secrets_reach_the_worker_through_its_environment_not_its_command_line(tmp_path):
    """Bug: --admin-api-key=... was on every worker's command line, readable by anyone with ps."""
    text = '[[workers]]\nname = "w0"\nmodel = "m"\nport = 31001\nadmin_api_key = "s3cret"\napi_key = "k3y"\n'
    (w0,) = load_spec(write(tmp_path, text), {}).workers
    assert not [f for f in w0.flags if "s3cret" in f or "k3y" in f]
    assert w0.env == {"KVFLEET_ADMIN_API_KEY": "s3cret", "KVFLEET_API_KEY": "k3y"}
    assert w0.admin_api_key == "s3cret"


def test_sglang_pd_flags_and_a_new_role(tmp_path):
    text = (
        '[[workers]]\nname = "p0"\nmodel = "smollm2"\nport = 31001\ndisaggregation_mode = "prefill"\n'
        'disaggregation_bootstrap_port = 9001\ndisaggregation_transfer_backend = "fake"\n'
        "enable_pd_role_switch = true\n"
    )
    (w,) = load_spec(write(tmp_path, text), {}).workers
    assert w.role == "prefill" and "--disaggregation-mode=prefill" in w.flags
    assert {"--disaggregation-bootstrap-port=9001", "--enable-pd-role-switch"} <= set(w.flags)
    d = with_role(w, "decode")
    args = parse_args(d.flags)
    assert (d.role, args.disaggregation_mode, args.disaggregation_bootstrap_port) == (
        "decode",
        "decode",
        9001,
    )
    assert args.enable_pd_role_switch and args.disaggregation_transfer_backend == "fake"
    with pytest.raises(ValueError, match="cannot run as mixed: --enable-pd-role-switch needs"):
        with_role(w, "mixed")


def test_the_demo_fleet_records_its_traffic_so_the_capacity_page_can_calibrate():
    """`make demo`'s workers run with --record-trace: the capacity page's calibration card then replays the
    demo's own traffic and shows a measured figure instead of "no recorded traffic"."""
    spec_file = Path(__file__).resolve().parents[2] / "deploy" / "fleet.demo.toml"
    env = {
        "KVFLEET_WORKER_ADMIN_KEY": "k",
        "MOONCAKE_MASTER": "m:1",
        "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE",
    }
    spec = load_spec(spec_file, env)
    assert len(spec.workers) == 2
    assert all("--record-trace" in w.flags for w in spec.workers)


ENCODER_SPEC = """\
[agent]
host_name = "node-a"
address = "10.1.2.3"
log_dir = "{log_dir}"

[[workers]]
name = "enc0"
model = "smollm2"
role = "encoder"
port = 31001

[[workers]]
name = "enc1"
model = "smollm2"
encoder_only = true
port = 31002
"""


def test_an_encoder_worker_runs_encoder_only_and_is_never_switched(tmp_path):
    from engine.agent.agent import role_of

    spec = load_spec(write(tmp_path, ENCODER_SPEC.format(log_dir=tmp_path / "logs")), {})
    enc0, enc1 = spec.workers
    assert enc0.role == enc1.role == "encoder"
    assert enc0.flags == ["--model-path=smollm2", "--port=31001", "--encoder-only"]
    assert enc1.flags.count("--encoder-only") == 1
    with pytest.raises(ValueError, match="EPD encoder: its role is not switched"):
        with_role(enc0, "prefill")
    assert role_of(enc0, {"encoder_only": True, "model_path": "smollm2"}) == "encoder"
    assert role_of(enc0, None) == "encoder"


def test_a_tp_worker_registers_its_tp_size_and_holds_its_devices(tmp_path):
    text = '[[workers]]\nname = "w0"\nmodel = "smollm2"\nport = 31001\ntp_size = 3\nbase_gpu_id = 2\n'
    (w0,) = load_spec(write(tmp_path, text)).workers
    assert "--tp-size=3" in w0.flags and w0.tp_size == 3
    assert w0.devices == [2, 3, 4]
    assert worker_record(w0)["tp_size"] == 3
    assert worker_record(w0, {"tp_size": 3, "disaggregation_mode": "null"})["tp_size"] == 3


def test_a_cuda_tp_worker_registers_the_gpus_its_ranks_hold_and_a_cpu_one_none(tmp_path):
    text = (
        '[[workers]]\nname = "w0"\nmodel = "smollm2"\nport = 31001\ntp_size = 2\nbase_gpu_id = 4\n'
        'device = "cuda"\n'
        '[[workers]]\nname = "w1"\nmodel = "smollm2"\nport = 31002\ntp_size = 2\n'
    )
    gpu, cpu = load_spec(write(tmp_path, text)).workers
    assert worker_record(gpu)["devices"] == [4, 5]
    # what the running worker reports wins over the spec
    info = {"device": "cuda", "base_gpu_id": 0, "tp_size": 2, "disaggregation_mode": "null"}
    assert worker_record(gpu, info)["devices"] == [0, 1]
    assert worker_record(cpu)["devices"] == []
    assert worker_record(cpu, {"device": "cpu", "tp_size": 2})["devices"] == []


def test_a_new_command_line_is_checked_before_a_restart_with_it(tmp_path):
    """with_flags: the command line a restart_with_flags request names is checked by the engine's parser
    before the worker is touched; what a restart may not change is refused naming the flag."""
    text = '[[workers]]\nname = "w0"\nmodel = "smollm2"\nport = 31001\npage_size = 16\nadmin_api_key = "s3"\n'
    (w0,) = load_spec(write(tmp_path, text), {}).workers
    record = worker_record(w0)
    assert record["command_line"] == w0.flags and not any("s3" in f for f in w0.flags)
    assert record["launch_flags"]["page_size"] == ["--page-size", True]
    assert record["launch_flags"]["enable_hierarchical_cache"] == ["--enable-hierarchical-cache", False]
    bigger = with_flags(w0, [f.replace("--page-size=16", "--page-size=32") for f in w0.flags])
    assert bigger.page_size == 32 and "--page-size=32" in bigger.flags and bigger.env == w0.env
    refused = {
        "--pge-size=32": "--pge-size is not a launch flag of KVFleet's engine; did you mean '--page-size'?",
        "--admin-api-key=x": "--admin-api-key carries a secret",
        "--port=31002": "--port cannot change by a restart ('31001' -> '31002')",
        "--disaggregation-mode=prefill": "--disaggregation-mode cannot change by a restart",
        "--hicache-storage-backend=file": "refused by KVFleet's parser: --hicache-storage-backend needs",
    }
    for item, says in refused.items():
        flags = [f for f in w0.flags if not f.startswith(item.split("=")[0] + "=")] + [item]
        with pytest.raises(ValueError, match=re.escape(says)):
            with_flags(w0, flags)
