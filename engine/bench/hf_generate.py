"""KVFleet's model runner vs HF transformers ``generate`` on the same weights: decode tokens/s.

``python -m engine.bench.hf_generate [--batches 1 8] [--prompt 256] [--new 64] [--reps 3] [--threads 1]
[--variants float32 bfloat16+int8wo]``

Both sides get the same SmolLM2-135M weights (the GGUF dequantized to float32; transformers'
``LlamaForCausalLM`` built on those tensors), the same random 256-token prompts and greedy decoding of 64 new
tokens without an EOS stop, on the same number of torch threads. Decode tokens/s = ``batch * (new - 1)``
over the wall time from the first new token to the last, so prefill is left out on both sides: for HF the
clock starts at the first call of a logits processor (``generate`` calls it right after the prefill forward),
for ours after the prefill's argmax. Ours decodes the way the scheduler does: one ``ForwardBatch.for_decode``
step per token over a paged pool (page size 1, slots of the sequences interleaved). Repetitions alternate
which side goes first; the ratio is taken within one repetition; printed: median (min-max) over them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from engine.cache.device_pool import DeviceKVPool
from engine.model.forward_batch import ForwardBatch
from engine.model.loader import Checkpoint, load_checkpoint
from engine.model.runner import ModelRunner


def hf_model(ckpt: Checkpoint) -> transformers.LlamaForCausalLM:
    """transformers' Llama on the checkpoint's float32 tensors (tied embeddings, default RoPE)."""
    c = ckpt.config
    cfg = transformers.LlamaConfig(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        vocab_size=c.vocab_size,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=True,
        max_position_embeddings=c.max_position_embeddings,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    model.load_state_dict(ckpt.tensors, assign=True, strict=False)
    model.model.rotary_emb = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    model.tie_weights()
    return model.eval()


class _FirstCall(transformers.LogitsProcessor):
    """Records when ``generate`` first asks for logits processing (after the prefill forward)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.at is None:
            self.at = time.perf_counter()
        return scores


def hf_decode_seconds(model: transformers.LlamaForCausalLM, prompts: torch.Tensor, new: int) -> float:
    """Wall seconds from the first to the last new token of ``generate`` (greedy, exactly ``new`` tokens)."""
    first = _FirstCall()
    with torch.inference_mode():
        model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            logits_processor=transformers.LogitsProcessorList([first]),
        )
    return time.perf_counter() - first.at


def ours_decode_seconds(runner: ModelRunner, prompts: torch.Tensor, new: int) -> float:
    """Wall seconds of the ``new - 1`` greedy decode steps after one batched prefill of the prompts."""
    b, p = prompts.shape
    pool = DeviceKVPool(b * (p + new), 1, **vars(runner.kv_pool_spec()))
    slots = [torch.arange(i, b * (p + new), b) + 1 for i in range(b)]  # sequences interleaved slot by slot
    logits = runner.forward(ForwardBatch.from_sequences(prompts.tolist(), [s[:p] for s in slots]), pool)
    last = logits.argmax(-1).tolist()
    t0 = time.perf_counter()
    for n in range(p + 1, p + new):
        logits = runner.forward(ForwardBatch.for_decode(last, [s[:n] for s in slots]), pool)
        last = logits.argmax(-1).tolist()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", nargs="+", default=["float32"], help="ours: dtype[+quantization]")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(args.model_path)
    hf = hf_model(ckpt)
    ours = {}
    for spec in args.variants:
        dtype, _, quant = spec.partition("+")
        ours[spec] = ModelRunner.from_checkpoint(ckpt, dtype=dtype, quantization=quant or None)
    gen = torch.Generator().manual_seed(0)
    print(f"prompt {args.prompt}, {args.new} new tokens, {args.threads} threads, {args.reps} repetitions")
    print(f"{'batch':>5}  {'side':<24}{'decode tok/s':>14}   ours / HF decode tok/s (median, min-max)")
    for batch in args.batches:
        prompts = torch.randint(3, ckpt.config.vocab_size, (batch, args.prompt), generator=gen)
        sides = {"transformers generate": lambda pr=prompts: hf_decode_seconds(hf, pr, args.new)}
        for spec, runner in ours.items():
            sides[f"KVFleet {spec}"] = lambda r=runner, pr=prompts: ours_decode_seconds(r, pr, args.new)
        rates: dict[str, list[float]] = {name: [] for name in sides}
        for rep in range(args.reps):
            for name in sides if rep % 2 == 0 else list(sides)[::-1]:
                rates[name].append(batch * (args.new - 1) / sides[name]())
        base = rates["transformers generate"]
        for name, r in rates.items():
            ratios = [x / y for x, y in zip(r, base, strict=True)]
            spread = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
            print(f"{batch:>5}  {name:<24}{statistics.median(r):>14.1f}   {spread}")


if __name__ == "__main__":
    main()
