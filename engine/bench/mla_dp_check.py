"""The GPU check's MLA and DP-attention cases (``python -m engine.bench.kernels`` runs them after the kernel
checks; ``--tiny`` on a CPU runs the same logic with small shapes).

1. MLA decode attention on the device: the absorbed-latent path against expanding the latent through
   ``kv_b_proj`` (``engine.bench.mla.decode_attention``, DeepSeek-V3's per-head sizes), the largest relative
   difference within 1e-3, and their times.
2. A tiny random DeepSeek-V3 (MLA + MoE with a shared expert, written by transformers) served by real
   worker processes on the device: ``--tp-size 2 --dp-size 2 --enable-dp-attention`` (two DP ranks sharing
   the one device) gives the greedy tokens of a dp-1 worker, and a conversation's next turn is served from
   the L1 of the DP rank that holds its first turn (``/server_info``'s ``internal_states``).

Each check returns its failures as strings (empty: passed) and prints what it measured.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import httpx
import torch

from engine.bench import mla
from engine.bench.launcher import ServerProcess

VOCAB = 512
PROMPT_TOKENS = 48


def write_tiny_deepseek(folder: Path) -> None:
    """A 2-layer random DeepSeek-V3 (latent 32 + 16, layer 1 routed over 8 experts, top 2 of 2 groups, one
    shared expert) and a word-level tokenizer over its vocabulary."""
    import tokenizers
    import transformers

    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=512, initializer_range=0.2,
        kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
        first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=32, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
    )  # fmt: skip
    transformers.DeepseekV3ForCausalLM(cfg).eval().save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0")).save(
        str(folder / "tokenizer.json")
    )
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1"}))


def check_mla_decode(device: torch.device, tiny: bool) -> list[str]:
    heads, context, batch, steps = (2, 32, 1, 1) if tiny else (16, 4096, 8, 10)
    expanded, absorbed, diff = mla.decode_attention(heads, context, batch, steps, device.type)
    print(
        f"MLA decode attention, {batch} seqs x {context + 1} tokens, {heads} heads, latent 512 + 64, "
        f"float32: expanded {expanded * 1e3:.2f} ms, absorbed {absorbed * 1e3:.2f} ms, ratio "
        f"{expanded / absorbed:.1f}x, max relative difference {diff:.1e}"
    )
    return [] if diff <= 1e-3 else [f"MLA absorbed decode differs from expanded by {diff:.1e} (> 1e-3)"]


def _generate(client: httpx.Client, ids: list[int]) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    resp = client.post("/generate", json=body)
    resp.raise_for_status()
    return resp.json()["output_ids"]


def _hits_after(client: httpx.Client, before: list[int], timeout: float = 60.0) -> list[int]:
    """Each DP rank's L1 hit tokens once some rank's count moved past ``before`` (a rank publishes its state
    after the step that answered), or as they stand after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        hits = [s["hit_tokens"]["device"] for s in client.get("/server_info").json()["internal_states"]]
        if hits != before or time.monotonic() > deadline:
            return hits
        time.sleep(0.05)


def check_dp_attention(device: torch.device) -> list[str]:
    """dp 2 == dp 1 on the tiny DeepSeek-V3, and a conversation's next turn hits its own DP rank's L1."""
    prompts = [[(7 * i + 3 * j) % (VOCAB - 20) + 10 for j in range(PROMPT_TOKENS)] for i in range(4)]
    failures = []
    with tempfile.TemporaryDirectory(prefix="kvfleet-mla-dp-") as tmp:
        folder = Path(tmp)
        write_tiny_deepseek(folder)
        base = ["--model-path", str(folder), "--device", device.type, "--page-size", "4"]
        outputs = []
        for extra in ([], ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"]):
            with (
                ServerProcess([*base, *extra], 600) as server,
                httpx.Client(base_url=server.url, timeout=300) as c,
            ):
                outputs.append([_generate(c, p) for p in prompts])
                if not extra:
                    continue
                states = c.get("/server_info").json()["internal_states"]
                dispatched = [s["num_dispatched_reqs"] for s in states]
                before = [s["hit_tokens"]["device"] for s in states]
                _generate(c, prompts[0] + [t % VOCAB for t in outputs[1][0]] + [5, 6, 7])  # its next turn
                after = _hits_after(c, before)
                print(
                    f"DP attention: dispatched {dispatched}; next turn's L1 hits per rank {before} -> {after}"
                )
                if dispatched != [2, 2]:
                    failures.append(f"DP dispatch of 4 unrelated prompts over 2 idle ranks: {dispatched}")
                # prompts[0] went first, to rank 0 (idle ranks: the lower one)
                if after[0] - before[0] < PROMPT_TOKENS - 4 or after[1] != before[1]:
                    failures.append(f"DP next turn not served from rank 0's L1: {before} -> {after}")
        if outputs[0] != outputs[1]:
            failures.append(f"DP attention dp 2 tokens differ from dp 1: {outputs[1]} != {outputs[0]}")
        print(
            f"DP attention on the tiny DeepSeek-V3 ({device.type}): dp 2 == dp 1: {outputs[0] == outputs[1]}"
        )
    return failures
