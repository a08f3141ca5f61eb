"""The demo's traffic generator tells how it is going while it runs (its log was empty until Ctrl-C)."""

from __future__ import annotations

from engine.bench import traffic


def test_the_totals_so_far_are_printed_every_progress_interval(monkeypatch, capsys):
    clock = iter([0.0, 10.0, 31.0, 40.0, 65.0])  # start, then one reading per request
    monkeypatch.setattr(traffic.time, "perf_counter", lambda: next(clock))
    run = traffic.Run(traffic.build_parser().parse_args(["--url", "http://x"]))  # --progress-s 30
    for tokens in (16, 32, 0, 48):
        run.log({"cached": {"device": tokens}} if tokens else {"error": "HTTP 503"})
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "traffic: 2 requests in 31s, 0 errors; cached prompt tokens device 48, host 0, storage 0",
        "traffic: 4 requests in 65s, 1 errors; cached prompt tokens device 96, host 0, storage 0",
    ]


def test_progress_zero_prints_only_at_the_end(monkeypatch, capsys):
    run = traffic.Run(traffic.build_parser().parse_args(["--url", "http://x", "--progress-s", "0"]))
    for _ in range(3):
        run.log({"cached": {"device": 1}})
    assert capsys.readouterr().out == ""
