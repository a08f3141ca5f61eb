"""``python -m engine.launch_server`` flag handling: answers before the model stack loads, and an unknown
flag names the real one (closest match, a mistaken spelling's real flag, or "not supported by KVFleet")."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from engine.server.args import ArgumentError, build_parser, parse_args
from engine.server.upstream_flags import MISTAKEN, NOT_YET, UNSUPPORTED

# Runs the module as `python -m` does, then reports the exit code and which heavy modules got imported.
_RUN = """
import json, runpy, sys
sys.argv = ["engine.launch_server", *json.loads(sys.argv[1])]
try:
    runpy.run_module("engine.launch_server", run_name="__main__", alter_sys=True)
    code = None
except SystemExit as exc:
    code = exc.code
heavy = [m for m in ("torch", "uvicorn", "transformers", "engine.model.runner") if m in sys.modules]
print(json.dumps({"code": code, "heavy": heavy}))
"""


@pytest.mark.parametrize(
    ("argv", "code", "says"),
    [
        (["--help"], 0, "--enable-hierarchical-cache"),
        (["--model-path", "m", "--enable-hicache"], 2, "use --enable-hierarchical-cache"),
        (["--model-path", "m", "--page-size", "zero"], 2, "--page-size must be an integer"),
    ],
)
def test_help_and_flag_errors_answer_without_importing_the_model_stack(argv, code, says):
    done = subprocess.run(
        [sys.executable, "-c", _RUN, json.dumps(argv)], capture_output=True, text=True, timeout=60
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"code": code, "heavy": []}, done.stderr
    assert says in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("flag", "real"),
    [
        ("--enable-hicache", "use --enable-hierarchical-cache"),
        ("--hicache-mem-pool-size=8", "use --hicache-size or --hicache-ratio"),
    ],
)
def test_a_mistaken_spelling_names_the_real_flags(flag, real):
    with pytest.raises(ArgumentError) as exc:
        parse_args(["--model-path", "m", flag])
    assert str(exc.value) == f"unrecognized argument {flag.split('=')[0]}: {real}"


def test_an_upstream_flag_kvfleet_lacks_is_not_supported_not_unrecognized():
    with pytest.raises(ArgumentError) as exc:
        parse_args(["--model-path", "m", "--cpu-offload-gb", "4"])
    assert str(exc.value) == "--cpu-offload-gb is an SGLang flag not supported by KVFleet"


@pytest.mark.parametrize("flag", ["--tp-size", "--tp", "--tensor-parallel-size"])
def test_tensor_parallel_flags_set_tp_size(flag):
    assert parse_args(["--model-path", "m", flag, "2"]).tp_size == 2


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--nnodes", "2"], "--nnodes 2: not supported by KVFleet"),
        (["--node-rank", "1"], "--node-rank 1: not supported by KVFleet"),
        (["--dist-init-addr", "nohost"], "--dist-init-addr must be host:port"),
        (["--tp", "0"], "--tp-size"),
    ],
)
def test_multi_node_flags_and_a_bad_tp_are_refused_naming_the_flag(flags, named):
    with pytest.raises(ArgumentError, match=re.escape(named)):
        parse_args(["--model-path", "m", *flags])


@pytest.mark.parametrize(
    ("typo", "suggested"),
    [
        ("--hicache-raito", "--hicache-ratio"),
        ("--model_path", "--model-path"),
        ("--enable-hierarchial-cache", "--enable-hierarchical-cache"),
    ],
)
def test_a_typo_suggests_the_closest_real_flag_first(typo, suggested):
    value = "m" if typo == "--model_path" else "3"
    argv = [typo, value] if typo == "--model_path" else ["--model-path", "m", typo, value]
    # the value stays with its flag, the hint comes after both
    with pytest.raises(
        ArgumentError, match=rf"^unrecognized arguments: {typo} {value} \(did you mean {suggested}\b"
    ):
        parse_args(argv)


def test_the_upstream_lists_name_no_real_flag_and_point_only_at_real_ones():
    real = {option for action in build_parser()._actions for option in action.option_strings}
    assert not real & (set(UNSUPPORTED) | set(NOT_YET) | set(MISTAKEN))
    assert {target for targets in MISTAKEN.values() for target in targets} <= real


def test_expert_parallelism_above_one_is_refused_naming_why():
    assert parse_args(["--model-path", "m", "--ep-size", "1"]).ep_size == 1
    with pytest.raises(
        ArgumentError, match=r"^--ep-size 2: expert parallelism is not built.*split by --tp-size"
    ):
        parse_args(["--model-path", "m", "--expert-parallel-size", "2"])


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (["--dp-size", "2"], r"^--dp-size 2 without --enable-dp-attention: .*behind the router"),
        (["--enable-dp-attention"], r"^--enable-dp-attention needs --dp-size > 1"),
        (["--dp", "2", "--enable-dp-attention"], r"^--dp-size 2 must divide --tp-size 1"),
        (
            ["--dp", "2", "--tp", "4", "--enable-dp-attention"],
            r"^--dp-size 2 with --tp-size 4: attention tensor",
        ),
        (
            ["--dp", "2", "--tp", "2", "--enable-dp-attention", "--disaggregation-mode", "prefill"],
            r"^--enable-dp-attention with --disaggregation-mode: DP attention runs on aggregated",
        ),
    ],
)
def test_data_parallel_attention_refusals_name_the_flag_and_why(flags, refusal):
    with pytest.raises(ArgumentError, match=refusal):
        parse_args(["--model-path", "m", *flags])


@pytest.mark.parametrize(
    ("flags", "suggests", "fixed"),
    [
        (["--dp-size", "2"], "did you mean --tp-size 2 (tensor", ["--tp-size", "2"]),
        (
            ["--dp-size", "2"],
            "or --enable-dp-attention --tp-size 2 (2 attention DP ranks",
            ["--dp-size", "2", "--enable-dp-attention", "--tp-size", "2"],
        ),
        (
            ["--dp-size", "2", "--tp-size", "2"],
            "or --enable-dp-attention (2 attention DP ranks",
            ["--dp-size", "2", "--tp-size", "2", "--enable-dp-attention"],
        ),
        (
            ["--tp-size", "4", "--enable-dp-attention"],
            "; add --dp-size 4, or leave out",
            ["--tp-size", "4", "--enable-dp-attention", "--dp-size", "4"],
        ),
        (
            ["--dp", "2", "--enable-dp-attention"],
            "; use --tp-size 2 (one attention rank",
            ["--dp", "2", "--enable-dp-attention", "--tp-size", "2"],
        ),
    ],
)
def test_a_data_parallel_refusal_suggests_the_real_flags_that_make_it_start(flags, suggests, fixed):
    """The refusal names --tp-size / --enable-dp-attention (and their values) as they fit the given flags,
    and the command line with the suggestion added parses."""
    with pytest.raises(ArgumentError) as exc:
        parse_args(["--model-path", "m", *flags])
    assert suggests in str(exc.value)
    assert parse_args(["--model-path", "m", *fixed])


def test_data_parallel_attention_parses_with_dp_equal_to_tp():
    args = parse_args(["--model-path", "m", "--tp", "2", "--dp-size", "2", "--enable-dp-attention"])
    assert (args.tp_size, args.dp_size, args.enable_dp_attention) == (2, 2, True)
