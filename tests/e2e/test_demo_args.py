"""`make demo`'s own arguments: a value it does not know is refused before anything starts, naming it."""

from __future__ import annotations

import os
import subprocess

from localfleet import REPO


def _demo(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["scripts/demo.sh", *args],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_pd_value_other_than_on_or_off_is_refused_naming_it():
    done = _demo(PD="maybe")
    assert done.returncode == 2 and "KVFleet demo" not in done.stdout
    assert done.stderr.strip() == (
        "make demo: PD=maybe: use PD=1 for prefill + decode workers behind the router, or leave PD out"
    )


def test_a_mistyped_flag_names_the_closest_real_one():
    done = _demo("--duraton", "5")
    assert done.returncode == 2 and "KVFleet demo" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last == "make demo: error: unrecognized arguments: --duraton 5 (did you mean --duration?)"


def test_an_engine_other_than_kvfleet_or_sglang_is_refused_naming_it():
    done = _demo(ENGINE="vllm")
    assert done.returncode == 2 and "KVFleet demo" not in done.stdout
    assert done.stderr.strip() == (
        "make demo: ENGINE=vllm: use ENGINE=sglang for upstream SGLang workers, or leave ENGINE out"
    )


def test_pd_on_upstream_sglang_is_refused_saying_why():
    done = _demo(ENGINE="sglang", PD="1")
    assert done.returncode == 2 and "KVFleet demo" not in done.stdout
    assert "PD on upstream SGLang needs a GPU" in done.stderr
