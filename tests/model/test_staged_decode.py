"""Decode K/V staged across steps (``engine/model/attention/staged_decode.py``) give exactly the logits of
gathering from the pool every step, whatever the next batch is: the same sequences one longer, one leaving,
one joining after a prefill, rows reordered, other sequences with the lengths the staged ones would have next,
another pool with the same slots, a row outgrowing the staged capacity, a new sequence (another
``seq_keys`` object) whose K/V were written onto the slots of the one it replaces."""

from __future__ import annotations

import pytest
import torch
from model_testlib import PageAllocator

from engine.cache.device_pool import DeviceKVPool
from engine.model.attention.staged_decode import STAGE_HEADROOM, DecodeStage
from engine.model.forward_batch import ForwardBatch
from engine.model.runner import ModelRunner


class Pair:
    """The same model twice: ``staged`` stages decode K/V, ``gathered`` never does (``max_bytes`` 0); both
    write to their own pool, filled identically. Both decode on the Python path unless ``staged`` /
    ``gathered`` (ModelRunner keyword arguments) say otherwise (``test_fused_decode.py``). Each decode step's
    logits must be equal, or within ``tolerance`` of ``gathered``'s largest logit when one is given; every
    step's ``(staged, gathered)`` logits are kept in ``logits``."""

    def __init__(
        self,
        folder,
        pool_size: int = 1024,
        staged: dict | None = None,
        gathered: dict | None = None,
        tolerance: float | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.tolerance = tolerance
        self.logits: list[tuple[torch.Tensor, torch.Tensor]] = []
        python_path = {"dtype": "float32", "fused_decode": False}
        self.staged = ModelRunner(folder, **{**python_path, **(staged or {})})
        self.gathered = ModelRunner(folder, **{**python_path, **(gathered or {})})
        self.gathered.model.attn._stage = DecodeStage(max_bytes=0)
        spec = vars(self.staged.kv_pool_spec())
        self.pools = {
            "staged": DeviceKVPool(pool_size, 1, **spec, kv_cache_dtype=kv_cache_dtype),
            "gathered": DeviceKVPool(pool_size, 1, **spec, kv_cache_dtype=kv_cache_dtype),
        }
        self.alloc = PageAllocator(self.pools["staged"], seed=3)
        self.seqs: dict[str, tuple[list[int], torch.Tensor]] = {}  # name -> (token ids, slots)
        self.vocab = self.staged.config.vocab_size

    def prefill(self, name: str, length: int, seed: int) -> None:
        ids = torch.randint(3, self.vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
        slots = self.alloc.extend(torch.zeros(0, dtype=torch.long), length)
        for runner, pool in ((self.staged, self.pools["staged"]), (self.gathered, self.pools["gathered"])):
            runner.forward(ForwardBatch.from_sequences([ids], [slots]), pool)
        self.seqs[name] = (ids, slots)

    def decode(
        self, names: list[str], staged_pool: DeviceKVPool | None = None, keys: list | None = None
    ) -> None:
        """One decode step of ``names`` (in that order, ``keys`` as their ``seq_keys``) on both; their logits
        must agree (see the class); the sequences go on with ``gathered``'s greedy tokens."""
        last, slots = [], []
        for name in names:
            ids, s = self.seqs[name]
            s = self.alloc.extend(s, s.shape[0] + 1)
            self.seqs[name] = (ids, s)
            last.append(ids[-1])
            slots.append(s)
        batch = ForwardBatch.for_decode(last, slots, seq_keys=keys)
        got = self.staged.forward(batch, staged_pool or self.pools["staged"])
        want = self.gathered.forward(ForwardBatch.for_decode(last, slots), self.pools["gathered"])
        if self.tolerance is None:
            assert torch.equal(got, want), (names, (got - want).abs().max().item())
        else:
            gap = ((got - want).abs().max() / want.abs().max()).item()
            assert gap <= self.tolerance, (names, gap)
        self.logits.append((got, want))
        for name, tok in zip(names, want.argmax(-1).tolist(), strict=True):
            self.seqs[name][0].append(tok)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "int8"])
def test_staged_decode_equals_gathering_across_batch_changes(tiny_models, kv_cache_dtype):
    pair = Pair(tiny_models["llama"][0], kv_cache_dtype=kv_cache_dtype)
    for name, length in (("a", 9), ("b", 23), ("c", 5)):
        pair.prefill(name, length, seed=length)
    for _ in range(3):  # the same sequences one token longer: appended, not gathered
        pair.decode(["a", "b", "c"])
    pair.decode(["a", "c"])  # b left
    pair.decode(["a", "c"])
    pair.prefill("d", 14, seed=14)  # a prefill between decode steps
    pair.decode(["a", "c", "d"])
    pair.decode(["c", "a", "d"])  # reordered rows
    pair.decode(["c", "a", "d"])
    # e and f have the lengths c and a would have next, on other slots
    lens = {n: pair.seqs[n][1].shape[0] for n in ("c", "a", "d")}
    pair.prefill("e", lens["c"], seed=1)
    pair.prefill("f", lens["a"], seed=2)
    pair.decode(["c", "a", "d"])  # (refills after the prefills above)
    pair.decode(["e", "f", "d"])  # d continues; e, f look like c, a one longer
    for _ in range(STAGE_HEADROOM + 2):  # past the capacity of the staged buffers
        pair.decode(["e", "f", "d"])


def test_staged_decode_refills_for_another_pool(tiny_models):
    pair = Pair(tiny_models["llama"][0])
    pair.prefill("a", 12, seed=4)
    pair.prefill("b", 7, seed=5)
    pair.decode(["a", "b"])
    other = DeviceKVPool(1024, 1, **vars(pair.staged.kv_pool_spec()))
    other.kv_buffer.copy_(pair.pools["staged"].kv_buffer)
    other.kv_buffer[:, :, pair.seqs["a"][1][:3]] += 1.0  # same slots, different K/V: must not be reused
    pair.pools["gathered"].kv_buffer.copy_(other.kv_buffer)
    pair.decode(["a", "b"], staged_pool=other)
    pair.pools["staged"] = other
    pair.decode(["a", "b"])


def test_a_new_sequence_on_freed_slots_is_refilled(tiny_models):
    """As on a PD decode worker: b's K/V land on the slots a held (no prefill batch in between) and b's first
    decode step looks like a's next one; b's own ``seq_keys`` object makes it a refill."""
    pair = Pair(tiny_models["llama"][0])
    pair.prefill("a", 10, seed=6)
    lease_a, lease_b = object(), object()
    pair.decode(["a"], keys=[lease_a])
    pair.decode(["a"], keys=[lease_a])
    ids, slots = pair.seqs["a"]
    for pool in pair.pools.values():  # other K/V on a's slots, as a transfer writes them
        pool.kv_buffer[:, :, slots] = torch.randn(
            pool.kv_buffer[:, :, slots].shape, generator=torch.Generator()
        )
    pair.seqs["b"] = (list(ids), slots)
    pair.decode(["b"], keys=[lease_b])
    pair.decode(["b"], keys=[lease_b])
