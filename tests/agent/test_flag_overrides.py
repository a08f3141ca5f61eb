"""Flag changes a restart-with-flags request made outlast the agent: kept in <log_dir>/agent-flags.json as
an edit of the spec file's flags, applied at the next start while the file's flags are the same."""

from __future__ import annotations

import json
import logging

from engine.agent.flag_overrides import FILE_NAME, FlagOverrides, apply_edit, edit_between
from engine.agent.spec import load_spec, with_flags, with_role

WORKER = '[[workers]]\nname = "w0"\nmodel = "smollm2"\nport = 31001\npage_size = 16\n{extra}'


def _worker(tmp_path, extra=""):
    path = tmp_path / "fleet.toml"
    path.write_text(f'[agent]\nlog_dir = "{tmp_path / "logs"}"\n\n' + WORKER.format(extra=extra))
    spec = load_spec(str(path), {})
    return spec, spec.workers[0]


def test_an_edit_turns_the_file_flags_into_the_new_ones_and_leaves_identity_and_role_out():
    file_flags = [
        "--model-path=m",
        "--port=1",
        "--page-size=16",
        "--enable-metrics",
        "--max-running-requests=4",
    ]
    new = ["--model-path=m", "--port=1", "--page-size=32", "--enable-metrics", "--chunked-prefill-size=64"]
    edit = edit_between(file_flags, new)
    assert edit == {
        "set": {"--page-size": "--page-size=32", "--chunked-prefill-size": "--chunked-prefill-size=64"},
        "remove": ["--max-running-requests"],
    }
    assert apply_edit(file_flags, edit) == new
    assert edit_between(file_flags, file_flags) == {"set": {}, "remove": []}
    switched = [*new, "--disaggregation-mode=decode"]  # a role is not a flags change
    assert edit_between(file_flags, switched) == edit


def test_a_kept_change_is_applied_at_the_next_start_and_a_change_back_removes_it(tmp_path):
    spec, w0 = _worker(tmp_path)
    overrides = FlagOverrides(spec.log_dir, {w0.name: w0.flags})
    assert overrides.applied(w0) is w0  # nothing kept yet
    bigger = with_flags(w0, [f.replace("--page-size=16", "--page-size=32") for f in w0.flags])
    overrides.record("w0", bigger.flags)
    kept = json.loads((tmp_path / "logs" / FILE_NAME).read_text())
    assert kept == {"w0": {"spec_flags": w0.flags, "set": {"--page-size": "--page-size=32"}, "remove": []}}

    _, again = _worker(tmp_path)  # the agent's next run, same spec file
    started = FlagOverrides(spec.log_dir, {again.name: again.flags}).applied(again)
    assert started.flags == bigger.flags and started.page_size == 32

    overrides.record("w0", w0.flags)  # restarted with the file's flags again (a rollback)
    assert json.loads((tmp_path / "logs" / FILE_NAME).read_text()) == {}


def test_a_role_switched_worker_keeps_its_flags_change_with_the_file_role(tmp_path):
    spec, w0 = _worker(tmp_path, 'disaggregation_mode = "prefill"\n')
    decode = with_role(w0, "decode")
    changed = with_flags(decode, [f.replace("--page-size=16", "--page-size=32") for f in decode.flags])
    FlagOverrides(spec.log_dir, {w0.name: w0.flags}).record("w0", changed.flags)
    started = FlagOverrides(spec.log_dir, {w0.name: w0.flags}).applied(w0)
    assert started.role == "prefill" and started.page_size == 32


def test_an_edited_spec_file_wins_and_drops_the_kept_change(tmp_path, caplog):
    spec, w0 = _worker(tmp_path)
    bigger = with_flags(w0, [f.replace("--page-size=16", "--page-size=32") for f in w0.flags])
    FlagOverrides(spec.log_dir, {w0.name: w0.flags}).record("w0", bigger.flags)
    spec, edited = _worker(tmp_path, "max_running_requests = 4\n")  # the operator edited the file
    with caplog.at_level(logging.WARNING, logger="kvfleet.agent"):
        started = FlagOverrides(spec.log_dir, {edited.name: edited.flags}).applied(edited)
    assert started is edited and started.page_size == 16
    assert "the spec file's flags changed since" in caplog.text
    assert json.loads((tmp_path / "logs" / FILE_NAME).read_text()) == {}


def test_a_kept_change_the_engine_now_refuses_is_dropped_naming_why(tmp_path, caplog):
    spec, w0 = _worker(tmp_path)
    (tmp_path / "logs").mkdir()
    bad = {"w0": {"spec_flags": w0.flags, "set": {"--pge-size": "--pge-size=32"}, "remove": []}}
    (tmp_path / "logs" / FILE_NAME).write_text(json.dumps(bad))
    with caplog.at_level(logging.ERROR, logger="kvfleet.agent"):
        started = FlagOverrides(spec.log_dir, {w0.name: w0.flags}).applied(w0)
    assert started is w0 and "did you mean '--page-size'" in caplog.text
    (tmp_path / "logs" / FILE_NAME).write_text("{not json")
    with caplog.at_level(logging.ERROR, logger="kvfleet.agent"):
        assert FlagOverrides(spec.log_dir, {w0.name: w0.flags}).applied(w0) is w0
    assert "is not JSON" in caplog.text
    (tmp_path / "logs" / FILE_NAME).write_text("[]")  # JSON of the wrong shape: the same
    with caplog.at_level(logging.ERROR, logger="kvfleet.agent"):
        assert FlagOverrides(spec.log_dir, {w0.name: w0.flags}).applied(w0) is w0
    assert "is not a table of worker edits" in caplog.text
