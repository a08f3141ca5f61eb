"""Launch arguments: SGLang names and defaults, unknown flags and bad values rejected with the flag named."""

from __future__ import annotations

import importlib.util
import json
import logging

import httpx
import pytest

from engine.server.args import ArgumentError, parse_args


def test_defaults_follow_sglang():
    args = parse_args(["--model-path", "smollm2"])
    info = args.to_dict()
    assert info["model_path"] == "smollm2" and info["port"] == 30000 and info["page_size"] == 1
    assert info["enable_hierarchical_cache"] is False and info["hicache_ratio"] == 2.0
    assert info["hicache_size"] == 0 and info["hicache_write_policy"] == "write_through"
    assert info["hicache_mem_layout"] == "layer_first" and info["hicache_storage_backend"] is None
    assert info["hicache_io_backend"] == "kernel"  # upstream's default; the cache corrects it to direct
    assert info["radix_eviction_policy"] == "lru" and info["max_prefill_tokens"] == 16384
    assert info["disaggregation_mode"] == "null" and info["device"] == "cpu"
    assert info["torchao_config"] == "" and info["dtype"] == "auto"


def test_a_typical_sglang_hicache_command_parses():
    extra = json.dumps({"prefetch_threshold": 128, "file_path": "/tmp/x"})
    args = parse_args(
        ["--model-path", "m", "--host", "0.0.0.0", "--port", "30001", "--page-size", "64",
         "--enable-hierarchical-cache", "--hicache-ratio", "3", "--hicache-write-policy", "write_back",
         "--hicache-mem-layout", "page_first", "--hicache-storage-backend", "file",
         "--hicache-storage-prefetch-policy", "timeout", "--hicache-storage-backend-extra-config", extra,
         "--enable-metrics", "--enable-cache-report", "--admin-api-key", "k", "--max-total-tokens", "8192"]
    )  # fmt: skip
    assert args.page_size == 64 and args.hicache_write_policy == "write_back"
    assert args.hicache_storage_backend_extra_config == extra and args.enable_metrics


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "mru", "filo", "priority", "arc"])
def test_every_eviction_policy_is_a_flag_choice(policy):
    args = parse_args(["--model-path", "m", "--radix-eviction-policy", policy])
    assert args.radix_eviction_policy == policy


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--model-path", "m", "--enable-turbo"], "--enable-turbo"),
        (["--model-path", "m", "--hicache-write-policy", "sometimes"], "--hicache-write-policy"),
        (["--model-path", "m", "--page-size", "0"], "--page-size"),
        (["--model-path", "m", "--port", "http"], "--port"),
        (["--model-path", "m", "--mem-fraction-static", "1.5"], "--mem-fraction-static"),
        (["--model-path", "m", "--chunked-prefill-size", "0"], "--chunked-prefill-size"),
        (
            ["--model-path", "m", "--page-size", "16", "--chunked-prefill-size", "100"],
            "--chunked-prefill-size",
        ),
        (["--model-path", "m", "--hicache-storage-backend", "file"], "--hicache-storage-backend"),
        (["--model-path", "m", "--enable-hierarchical-cache", "--hicache-ratio", "1"], "--hicache-ratio"),
        (
            ["--model-path", "m", "--hicache-storage-backend-extra-config", "{bad"],
            "--hicache-storage-backend",
        ),
        (["--model-path", "m", "--disaggregation-mode", "sideways"], "--disaggregation-mode"),
        (
            ["--model-path", "m", "--disaggregation-bootstrap-port", "70000"],
            "--disaggregation-bootstrap-port",
        ),
        (
            ["--model-path", "m", "--disaggregation-transfer-backend", "rdma"],
            "--disaggregation-transfer-backend",
        ),
        (["--model-path", "m", "--num-reserved-decode-tokens", "-1"], "--num-reserved-decode-tokens"),
        (["--model-path", "m", "--base-gpu-id", "-1"], "--base-gpu-id"),
        (["--model-path", "m", "--enable-pd-role-switch"], "--enable-pd-role-switch"),
        (
            ["--model-path", "m", "--disaggregation-decode-enable-offload-kvcache"],
            "--disaggregation-decode-enable-offload-kvcache",
        ),
        (["--model-path", "m", "--hicache-storage-backend", "s3"], "--hicache-storage-backend"),
        (["--model-path", "m", "--torchao-config", "int4wo-16"], "--torchao-config"),
        (
            ["--model-path", "m", "--torchao-config", "int4wo-32", "--device", "cuda"],
            "--torchao-config int4wo-32 needs",
        ),
        (
            ["--model-path", "m", "--torchao-config", "int4wo-32", "--dtype", "float32"],
            "--torchao-config int4wo-32 needs --device cpu and --dtype bfloat16",
        ),
        (["--port", "1"], "--model-path"),
    ],
)
def test_bad_flags_name_the_flag(argv, flag):
    with pytest.raises(ArgumentError, match=flag):
        parse_args(argv)


def test_triton_attention_needs_cuda_or_the_interpreter(monkeypatch):
    argv = ["--model-path", "m", "--attention-backend", "triton"]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ArgumentError, match="--attention-backend triton: Triton kernels need a CUDA device"):
        parse_args(argv)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert parse_args(argv).attention_backend == "triton"
    assert parse_args([*argv, "--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"  # the kernels dequantize


@pytest.mark.parametrize(
    ("flags", "layout"),
    [
        ([], "layer_first"),  # default io backend: kernel
        (["--hicache-io-backend", "kernel", "--hicache-mem-layout", "page_first"], "page_first_direct"),
        (["--hicache-io-backend", "direct"], "layer_first"),
    ],
)
def test_upstream_kernel_io_starts_and_server_info_shows_direct(serve, caplog, flags, layout):
    with caplog.at_level(logging.WARNING, logger="engine.cache.host_pool"):
        _, client = serve("--enable-hierarchical-cache", *flags)
    corrected = "direct" not in flags
    assert any("kernel io backend is not available" in r.getMessage() for r in caplog.records) is corrected
    info = client.get("/server_info").json()
    assert (info["hicache_io_backend"], info["hicache_mem_layout"]) == ("direct", layout)
    assert (info["hicache"]["hicache_io_backend"], info["hicache"]["hicache_mem_layout"]) == (
        "direct",
        layout,
    )
    body = {"input_ids": list(range(3, 40)), "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200 and len(resp.json()["output_ids"]) == 2


def test_secrets_come_from_a_file_or_the_environment_off_the_command_line(tmp_path, monkeypatch):
    key_file = tmp_path / "admin-key"
    key_file.write_text("from-file\n")
    model = ["--model-path", "smollm2"]
    assert parse_args([*model, "--admin-api-key-file", str(key_file)]).admin_api_key == "from-file"
    monkeypatch.setenv("KVFLEET_ADMIN_API_KEY", "from-env")
    monkeypatch.setenv("KVFLEET_API_KEY", "api-from-env")
    args = parse_args(model)
    assert (args.admin_api_key, args.api_key) == ("from-env", "api-from-env")
    assert parse_args([*model, "--admin-api-key", "flag"]).admin_api_key == "flag"  # upstream flag wins
    with pytest.raises(ArgumentError, match="--admin-api-key-file"):
        parse_args([*model, "--admin-api-key-file", str(tmp_path / "missing")])


def test_torchao_int8wo_builds_int8_layers_and_serves(tiny_model_dir):
    """``--torchao-config int8wo`` reaches the model (int8 LM head), shows in /server_info and generates."""
    from server_testlib import ThreadedServer

    from engine.model.linear import Int8WeightOnlyLinear
    from engine.server.builder import build_engine

    engine = build_engine(parse_args(["--model-path", str(tiny_model_dir), "--torchao-config", "int8wo"]))
    try:
        assert isinstance(engine.scheduler.runner.model.lm_head, Int8WeightOnlyLinear)
        with ThreadedServer(engine) as server, httpx.Client(base_url=server.url, timeout=60) as client:
            assert client.get("/server_info").json()["torchao_config"] == "int8wo"
            params = {"max_new_tokens": 3, "temperature": 0}
            resp = client.post("/generate", json={"input_ids": list(range(3, 20)), "sampling_params": params})
            assert resp.status_code == 200 and len(resp.json()["output_ids"]) == 3
    finally:
        engine.scheduler.stop()


@pytest.mark.parametrize("argv", [["--bogus"], ["--model-path", "m", "--bogus"], ["--port", "1", "--bogus"]])
def test_an_unknown_flag_is_named_before_a_missing_model_path(argv):
    with pytest.raises(ArgumentError, match="^unrecognized arguments: --bogus$"):
        parse_args(argv)


def test_torchao_int4wo_builds_int4_layers_and_refuses_a_group_the_model_cannot_take(tiny_model_dir):
    """``--dtype bfloat16 --torchao-config int4wo-32`` builds int4 layers and generates; int4wo-128 on the
    tiny model (64 input columns) fails at load with a CLI error naming the flag."""
    from server_testlib import ThreadedServer

    from engine.model.linear import Int4WeightOnlyLinear
    from engine.server.builder import build_engine

    flags = ["--model-path", str(tiny_model_dir), "--dtype", "bfloat16", "--torchao-config"]
    with pytest.raises(ArgumentError, match="--torchao-config int4wo-128: a .* weight needs in_features"):
        build_engine(parse_args([*flags, "int4wo-128"]))
    engine = build_engine(parse_args([*flags, "int4wo-32"]))
    try:
        assert isinstance(engine.scheduler.runner.model.layers[0].mlp.gate_up, Int4WeightOnlyLinear)
        params = {"max_new_tokens": 3, "temperature": 0}
        with ThreadedServer(engine) as server, httpx.Client(base_url=server.url, timeout=60) as client:
            resp = client.post("/generate", json={"input_ids": list(range(3, 20)), "sampling_params": params})
            assert resp.status_code == 200 and len(resp.json()["output_ids"]) == 3
    finally:
        engine.scheduler.stop()


def test_help_shows_model_path_as_required(capsys):
    """``--help`` after the lenient first parse still marks ``--model-path`` required in its usage line."""
    with pytest.raises(SystemExit) as exc:
        parse_args(["--help"])
    assert exc.value.code == 0
    usage = " ".join(capsys.readouterr().out.split("\n\n")[0].split())
    assert usage.startswith("usage: python -m engine.launch_server [-h] --model-path MODEL_PATH [--host")


def test_a_hicache_ratio_of_1_or_less_is_refused_when_parsing_even_without_hicache():
    """The cache's config refuses it either way; parsing says so before the model loads."""
    with pytest.raises(ArgumentError, match=r"^--hicache-ratio must be > 1 .*got 0\.0$"):
        parse_args(["--model-path", "m", "--hicache-ratio", "0"])


def test_a_bad_cache_setting_names_its_flag_once(tiny_model_dir):
    from engine.server.builder import build_engine, hicache_config

    extra = parse_args(["--model-path", "m"])  # built by hand: parse_args itself refuses it (below)
    extra.hicache_storage_backend_extra_config = '{"prefetch_threshold": -1}'
    with pytest.raises(ArgumentError) as exc:
        hicache_config(extra)
    assert (
        str(exc.value) == "--hicache-storage-backend-extra-config: prefetch_threshold: must be >= 0, got -1"
    )
    args = parse_args(["--model-path", "m"])
    args.hicache_write_policy = "write_never"  # as a caller building ServerArgs by hand may
    with pytest.raises(ArgumentError, match=r"^--hicache-write-policy: 'write_never' is not one of "):
        hicache_config(args)
    bad = [
        "--model-path",
        str(tiny_model_dir),
        "--hicache-storage-backend-extra-config",
        '{"prefetch_threshold": -1}',
    ]
    with pytest.raises(ArgumentError) as exc:
        built = parse_args(bad[:2])
        built.hicache_storage_backend_extra_config = bad[3]
        build_engine(built)
    assert (
        str(exc.value) == "--hicache-storage-backend-extra-config: prefetch_threshold: must be >= 0, got -1"
    )


AIBRIX = ["--model-path", "m", "--enable-hierarchical-cache", "--hicache-storage-backend", "aibrix"]
FORMS = "(give AIBRIX_KV_CACHE_OL_<NAME> or <name> in lower case; e.g. l2_cache_backend, rocksdb_root)"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"l2_cache_backend": "ROCKSDB", "rocksdb_rot": "/l3", "prefetch_threshold": 4},
            f"rocksdb_rot: not an AIBrix KVCache setting {FORMS}; did you mean 'rocksdb_root'?",
        ),
        (
            {"AIBRIX_KV_CACHE_OL_L2_CACHE_BACKED": "MOCK"},
            f"AIBRIX_KV_CACHE_OL_L2_CACHE_BACKED: not an AIBrix KVCache setting {FORMS}; did you mean "
            "'AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND'?",
        ),
        ({"zzz": 1}, f"zzz: not an AIBrix KVCache setting {FORMS}"),
        ({"profiling_enabled": 1}, "profiling_enabled: AIBrix reads AIBRIX_KV_CACHE_OL_PROFILING_ENABLED"),
    ],
)
def test_a_bad_aibrix_key_is_refused_when_parsing_naming_the_flag_and_the_closest_key(extra, message):
    """Before the model loads (parse_args loads nothing), with the flag in front; the backend's build-time
    check (resolve_settings, the admin attach too) is the same function."""
    if importlib.util.find_spec("aibrix_kvcache") is None:
        pytest.skip("aibrix-kvcache not installed (requirements-aibrix.txt): the backend names it when built")
    with pytest.raises(ArgumentError) as exc:
        parse_args([*AIBRIX, "--hicache-storage-backend-extra-config", json.dumps(extra)])
    flag_and_key = f"--hicache-storage-backend-extra-config: {message}"
    assert str(exc.value) == flag_and_key or str(exc.value).startswith(f"{flag_and_key} once, at import")


def test_aibrix_settings_the_environment_may_give_are_not_asked_for_when_parsing():
    """Parsing checks keys only: the L2 backend may come from the worker's environment (an agent parses a
    spec whose env table it sets on the worker), and another backend's keys are its own to check."""
    assert parse_args([*AIBRIX, "--hicache-storage-backend-extra-config", '{"rocksdb_root": "/l3"}'])
    nixl = [*AIBRIX[:-1], "nixl", "--hicache-storage-backend-extra-config", '{"rocksdb_rot": 1}']
    assert parse_args(nixl).hicache_storage_backend == "nixl"  # not refused as an AIBrix key


def test_a_bad_lmcache_key_is_refused_when_parsing_naming_the_flag_and_the_closest_key():
    """No server is asked (none runs here): the keys are checked before the model loads; the URL itself may
    come from the worker's ``LMCACHE_REMOTE_URL``, so parsing does not ask for it."""
    lm = [*AIBRIX[:-1], "lmcache", "--hicache-storage-backend-extra-config"]
    with pytest.raises(ArgumentError) as exc:
        parse_args([*lm, '{"lmcache_ulr": "lm://h:1", "prefetch_threshold": 4}'])
    assert str(exc.value) == (
        "--hicache-storage-backend-extra-config: lmcache_ulr: not an lmcache backend key (known: "
        "lmcache_url, lmcache_timeout_s); did you mean 'lmcache_url'?"
    )
    assert parse_args([*lm, '{"lmcache_timeout_s": 5}']).hicache_storage_backend == "lmcache"


EXTRA = "--hicache-storage-backend-extra-config"


@pytest.mark.parametrize(
    ("backend", "extra", "message"),
    [
        ("file", {"prefetch_timeout_base": "2s"}, "prefetch_timeout_base: must be a number, got str '2s'"),
        (None, {"prefetch_threshold": -1}, "prefetch_threshold: must be >= 0, got -1"),
        (
            "lmcache",
            {"lmcache_timeout_s": "soon"},
            "lmcache_timeout_s: must be a number of seconds > 0, got 'soon",
        ),
        ("lmcache", {"lmcache_timeout_s": -1}, "lmcache_timeout_s: must be a number of seconds > 0, got -1"),
        (
            "lmcache",
            {"lmcache_url": "lm://cache-host"},
            "lmcache_url: 'lm://cache-host' is not lm://host:port",
        ),
        (
            "mooncake",
            {"master_server_address": "master:port"},
            "master_server_address: expected 'host:port' (a port in 1..65535), got 'master:port'",
        ),
        (
            "mooncake",
            {"master_server_address": "m:50051", "global_segment_size": -1},
            "global_segment_size: size must be positive, got -1",
        ),
        (
            "mooncake",
            {"master_server_address": "m:50051", "local_buffer_size": "lots"},
            "local_buffer_size: cannot parse size 'lots' (use bytes or e.g. '4gb', '512mb')",
        ),
        (  # no master named: the config file or environment is read, which would ignore the size
            "mooncake",
            {"global_segment_size": "512mb", "prefetch_threshold": 32},
            "global_segment_size: read only when this extra config names master_server_address",
        ),
        (
            "mooncake",
            {"master_server_address": "m:1", "protocol": "udp"},
            "protocol: expected 'tcp' or 'rdma'",
        ),
        ("file", {"file_path": 3}, "file_path: must be a directory path (a non-empty string), got 3"),
        (  # a misspelt HiCache key would be ignored by the file backend
            "file",
            {"file_path": "/l3", "prefetch_thresold": 3},
            "prefetch_thresold: not a key of the file backend (it takes file_path or file_storage_path) nor "
            "of HiCache; did you mean 'prefetch_threshold'?",
        ),
        ("dynamic", {"backend_name": "x", "module_path": "m"}, "class_name: required for the dynamic"),
    ],
)
def test_a_bad_extra_config_value_is_refused_when_parsing_naming_the_flag_the_key_and_what_it_expects(
    backend, extra, message
):
    """Before the model loads (parse_args loads nothing): a value the backend would refuse when built."""
    argv = ["--model-path", "m", EXTRA, json.dumps(extra)]
    if backend:
        argv += ["--enable-hierarchical-cache", "--hicache-storage-backend", backend]
    with pytest.raises(ArgumentError) as exc:
        parse_args(argv)
    assert str(exc.value).startswith(f"{EXTRA}: {message}")


def test_good_extra_config_values_and_ones_the_environment_gives_pass_parsing():
    """A mooncake extra config without a master is not read (the config file or environment is), so it
    may hold HiCache's keys only; the lmcache URL may come from LMCACHE_REMOTE_URL."""
    hicache = ["--model-path", "m", "--enable-hierarchical-cache", "--hicache-storage-backend"]
    good = {
        "mooncake": {"master_server_address": "10.0.0.1:1", "global_segment_size": "4gb", "protocol": "rdma"},
        "lmcache": {"lmcache_url": "lm://[::1]:65432", "lmcache_timeout_s": 2.5, "prefetch_timeout_base": 1},
        "file": {"file_path": "/l3", "prefetch_threshold": 0},
    }
    for backend, extra in good.items():
        assert parse_args([*hicache, backend, EXTRA, json.dumps(extra)]).hicache_storage_backend == backend
    assert parse_args([*hicache, "mooncake", EXTRA, '{"prefetch_threshold": 32}'])  # HiCache's key only


def test_grammar_and_tool_call_parser_flags():
    args = parse_args(["--model-path", "m", "--grammar-backend", "none", "--tool-call-parser", "llama3"])
    assert (args.grammar_backend, args.tool_call_parser) == ("none", "llama3")
    assert parse_args(["--model-path", "m"]).grammar_backend == "xgrammar"
    with pytest.raises(
        ArgumentError, match=r"--tool-call-parser: unknown parser 'qwen2' .*did you mean 'qwen25'\?$"
    ):
        parse_args(["--model-path", "m", "--tool-call-parser", "qwen2"])
    with pytest.raises(ArgumentError, match="--grammar-backend"):
        parse_args(["--model-path", "m", "--grammar-backend", "outlines"])
