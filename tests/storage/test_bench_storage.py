"""The storage benchmark runs end to end on tiny sizes and prints one row per operation."""

import re

import pytest

from engine.bench.storage import main

ROW = re.compile(r"^\| (file|mooncake|nixl|aibrix|lmcache) \| batch_(set|get) \| \d+ MB( \| [\d.]+){4} \|$")
AGAINST_FILE = re.compile(r"^\| batch_(set|get)( \| [\d.]+){4} \|$")


def run(capsys, backend, *extra, pattern=ROW):
    args = [
        "--backend",
        backend,
        "--pages",
        "4",
        "--page-size",
        "4",
        "--layers",
        "2",
        "--rounds",
        "2",
        *extra,
    ]
    assert main(args) == 0
    return [line for line in capsys.readouterr().out.splitlines() if pattern.match(line)]


@pytest.mark.parametrize("backend", ["file", "nixl"])
def test_page_file_benchmark_prints_set_and_get_rows(capsys, tmp_path, backend):
    rows = run(capsys, backend, "--dir", str(tmp_path))
    assert [r.split("|")[2].strip() for r in rows] == ["batch_set", "batch_get"]
    assert list(tmp_path.iterdir()) == [], "the benchmark removes its directory"


@pytest.mark.parametrize("backend", ["nixl", "aibrix", "lmcache"])
def test_benchmark_times_the_file_backend_in_the_same_rounds(capsys, tmp_path, backend, request):
    extra = []
    if backend == "lmcache":  # the session's server (skips, saying why, without LMCache's venv)
        extra = ["--lmcache-url", request.getfixturevalue("lmcache_server").url]
    out = run(capsys, backend, "--dir", str(tmp_path), "--compare-file", *extra, pattern=re.compile(".*"))
    rows = [line for line in out if AGAINST_FILE.match(line)]
    assert [r.split("|")[1].strip() for r in rows] == ["batch_set", "batch_get"]
    assert [r.split("|")[2].strip() for r in out if ROW.match(r)] == ["batch_set", "batch_get"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_mooncake_benchmark_prints_set_and_get_rows(capsys):
    rows = run(capsys, "mooncake")
    assert [r.split("|")[2].strip() for r in rows] == ["batch_set", "batch_get"]


def test_bad_flag_is_a_cli_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--backend", "file", "--pages", "0"])
    assert exc.value.code == 2
    assert "--pages must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--backend", "file", "--compare-file"])
    assert "--compare-file needs --backend nixl, aibrix or lmcache" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--backend", "file", "--lmcache-url", "lm://h:1"])
    assert "--lmcache-url needs --backend lmcache" in capsys.readouterr().err
