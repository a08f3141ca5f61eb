"""lm-evaluation-harness (the ``lm-eval`` package) against a worker: its ``local-completions`` model runs
small tasks from JSONLs this test writes and agrees with its ``hf`` backend (transformers, fp32) on the same
weights: a loglikelihood task gives the same per-item loglikelihoods (within 1e-3) and greedy flags, and a
``generate_until`` task (sent two prompts per request, as a list) the same greedy answers."""

from __future__ import annotations

import json

import pytest

from engine.bench.launcher import ServerProcess

pytestmark = pytest.mark.slow

TASK = "kvfleet_tiny_loglikelihood"
GEN_TASK = "kvfleet_tiny_generate_until"
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
    gen = folder / "prompts.jsonl"
    gen.write_text("".join(json.dumps({"context": c, "target": t}) + "\n" for c, t in ITEMS))
    (folder / f"{GEN_TASK}.yaml").write_text(
        f"task: {GEN_TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {gen}\n"
        "test_split: test\n"
        "output_type: generate_until\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_target: "{{target}}"\n'
        'generation_kwargs:\n  until: [".", "\\n"]\n  max_gen_toks: 12\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
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


def _responses(task_dir, task: str, model: str, model_args: str, batch_size: int = 1) -> list:
    """Each item's first response (in doc order) from lm-eval's ``simple_evaluate`` of ``task``."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=TaskManager(include_path=str(task_dir)),
        batch_size=batch_size,
        log_samples=True,
    )
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    return [s["resps"][0][0] for s in samples]


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets")))
        yield


@pytest.fixture(scope="module")
def server(tiny_model_dir, offline):
    with ServerProcess(["--model-path", str(tiny_model_dir)]) as proc:
        yield proc


def _served_args(server, tiny_model_dir) -> str:
    return (
        f"base_url={server.url}/v1/completions,model=tiny,tokenizer={tiny_model_dir},"
        "tokenizer_backend=huggingface,tokenized_requests=True,max_retries=1,max_length=512"
    )


def test_local_completions_matches_the_hf_backend(tiny_model_dir, task_dir, server):
    hf = f"pretrained={tiny_model_dir},dtype=float32,device=cpu"
    reference = [tuple(r) for r in _responses(task_dir, TASK, "hf", hf)]
    served = [
        tuple(r)
        for r in _responses(task_dir, TASK, "local-completions", _served_args(server, tiny_model_dir))
    ]
    assert len(served) == len(reference) == len(ITEMS)
    for (ll, greedy), (ref_ll, ref_greedy) in zip(served, reference, strict=True):
        assert abs(ll - ref_ll) < 1e-3
        assert greedy == ref_greedy


def test_generate_until_gives_the_hf_backends_greedy_answers(tiny_model_dir, task_dir, server):
    hf = f"pretrained={tiny_model_dir},dtype=float32,device=cpu"
    reference = _responses(task_dir, GEN_TASK, "hf", hf)
    args = _served_args(server, tiny_model_dir)
    served = _responses(task_dir, GEN_TASK, "local-completions", args, batch_size=2)  # lists of 2 prompts
    assert len(served) == len(reference) == len(ITEMS)
    assert served == reference
    assert any(reference)  # the answers are not all empty
