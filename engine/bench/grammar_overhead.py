"""Constrained decoding overhead: inter-token latency with a JSON schema vs the same requests without one.

``python -m engine.bench.grammar_overhead [--url URL] [--batch 4] [--rounds 4] [--tokens 64]``

Starts one worker (``--model-path smollm2`` by default, or uses ``--url``) and alternates rounds of
``--batch`` concurrent streamed ``/generate`` requests: unconstrained (``ignore_eos``) and constrained by a
JSON schema whose one string field must be longer than ``--tokens`` tokens can write, so both kinds decode
exactly ``--tokens`` tokens. ITL is a request's (last token time - first token time) / (tokens - 1), from
the stream's frames; printed: the median ITL of each kind, per round and overall, and their ratio (target
<= 1.1x). The first round of each kind is a warm-up (grammar compilation, caches) and is left out. Then,
in this process and without a model, the masking alone: median ms per step of ``apply_vocab_masks`` (fill
each row's bitmask, apply it) over the model's vocabulary, the matchers advanced by argmax, batch 1 and 4.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import time

import httpx

from engine.bench.launcher import ServerProcess

SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 2000}, "mood": {"enum": ["calm", "tense"]}},
    "required": ["story", "mood"],
}


def itl(url: str, prompt: str, tokens: int, schema: str | None) -> float:
    """Seconds per token after the first, of one streamed request."""
    sp = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": schema is None}
    if schema is not None:
        sp["json_schema"] = schema
    stamps: list[float] = []
    seen = 0
    body = {"text": prompt, "sampling_params": sp, "stream": True}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            n = len(json.loads(line[6:])["output_ids"])
            now = time.perf_counter()
            stamps += [now] * (n - seen)
            seen = n
    if seen != tokens:
        raise RuntimeError(f"expected {tokens} tokens, got {seen}")
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def round_itl(url: str, batch: int, tokens: int, schema: str | None, seed: int) -> float:
    """Median ITL of ``batch`` concurrent requests (distinct prompts, so no prefix is shared)."""
    prompts = [f"Story {seed}-{i}: write about a lighthouse keeper, in JSON." for i in range(batch)]
    with concurrent.futures.ThreadPoolExecutor(batch) as pool:
        return statistics.median(pool.map(lambda p: itl(url, p, tokens, schema), prompts))


def run(url: str, batch: int, rounds: int, tokens: int) -> None:
    schema = json.dumps(SCHEMA)
    free, constrained = [], []
    for r in range(rounds + 1):
        order = [None, schema] if r % 2 == 0 else [schema, None]
        got = {s: round_itl(url, batch, tokens, s, r) for s in order}
        if r == 0:
            continue  # warm-up
        free.append(got[None])
        constrained.append(got[schema])
        print(
            f"round {r}: ITL free {got[None] * 1e3:.2f} ms, json_schema {got[schema] * 1e3:.2f} ms, "
            f"ratio {got[schema] / got[None]:.3f} (load average {os.getloadavg()[0]:.1f})",
            flush=True,
        )
    f, c = statistics.median(free), statistics.median(constrained)
    print(f"\nbatch {batch}, {tokens} tokens, {rounds} rounds (after one warm-up)")
    print(f"median ITL: free {f * 1e3:.2f} ms, json_schema {c * 1e3:.2f} ms, ratio {c / f:.3f}")


def mask_ms(model_path: str, batch: int, steps: int = 64) -> float:
    """Median ms per step of masking ``batch`` rows of the model's logits by the benchmark's schema."""
    import torch

    from engine.grammar.backend import GrammarBackend
    from engine.grammar.state import GrammarState, apply_vocab_masks
    from engine.model.loader import load_checkpoint

    ck = load_checkpoint(model_path)
    vocab = ck.config.vocab_size
    backend = GrammarBackend(ck.tokenizer.backend, vocab, ck.tokenizer.eos_token_ids)
    compiled = backend.compile("json_schema", json.dumps(SCHEMA)).result()
    states = [GrammarState(compiled) for _ in range(batch)]
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(steps):
        row = logits.clone()
        start = time.perf_counter()
        row = apply_vocab_masks(row, states)
        times.append((time.perf_counter() - start) * 1e3)
        for state, tok in zip(states, row.argmax(-1).tolist(), strict=True):
            state.accept(tok)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running worker (default: start one)")
    ap.add_argument("--model-path", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    if args.url:
        run(args.url, args.batch, args.rounds, args.tokens)
    else:
        flags = ["--model-path", args.model_path, "--device", args.device, "--max-total-tokens", "8192"]
        with ServerProcess(flags, timeout=600) as server:
            run(server.url, args.batch, args.rounds, args.tokens)
    for batch in (1, 4):
        print(f"masking alone, batch {batch}: {mask_ms(args.model_path, batch):.3f} ms per step (median)")


if __name__ == "__main__":
    main()
