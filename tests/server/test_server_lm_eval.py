"""lm-evaluation-harness (the ``lm-eval`` package) against a worker: its ``local-completions`` model runs a
small loglikelihood task from a JSONL this test writes and gives the same per-item loglikelihoods and
greedy flags as its ``hf`` backend (transformers, fp32) on the same weights, within 1e-3."""

from __future__ import annotations

import json

import pytest

from engine.bench.launcher import ServerProcess

pytestmark = pytest.mark.slow

TASK = "kvfleet_tiny_loglikelihood"
ITEMS = [
    ("the quick brown", " fox jumps over the lazy dog"),
    ("a paged KV cache stores", " keys and values per token slot"),
    ("the lazy dog", " jumps"),
    ("keys and values", " per token slot, the quick brown fox"),
    ("caf\u00e9 na\u00efve", " done"),
    ("over the", " lazy dog"),
]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm-eval-task")
    data = folder / "items.jsonl"
    data.write_text("".join(json.dumps({"context": c, "continuation": t}) + "\n" for c, t in ITEMS))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: loglikelihood\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_target: "{{continuation}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    return folder


def _loglikelihoods(task_dir, model: str, model_args: str) -> list[tuple[float, bool]]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(task_dir)),
        batch_size=1,
        log_samples=True,
    )
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return [tuple(s["resps"][0][0]) for s in samples]


def test_local_completions_matches_the_hf_backend(tiny_model_dir, task_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    reference = _loglikelihoods(task_dir, "hf", f"pretrained={tiny_model_dir},dtype=float32,device=cpu")
    with ServerProcess(["--model-path", str(tiny_model_dir)]) as server:
        served = _loglikelihoods(
            task_dir,
            "local-completions",
            f"base_url={server.url}/v1/completions,model=tiny,tokenizer={tiny_model_dir},"
            "tokenizer_backend=huggingface,tokenized_requests=True,max_retries=1,max_length=512",
        )
    assert len(served) == len(reference) == len(ITEMS)
    for (ll, greedy), (ref_ll, ref_greedy) in zip(served, reference, strict=True):
        assert abs(ll - ref_ll) < 1e-3
        assert greedy == ref_greedy
