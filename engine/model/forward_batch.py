"""ForwardBatch: one forward pass over a mixed batch of sequences (prefill chunks and decodes).

Follows SGLang's ``ForwardBatch``: flat tokens, absolute positions, ``out_cache_loc``, and device tensors for
the attention kernels (a token page table, ``seq_lens``, and cumulative extend lengths), with host mirrors of
the lengths so no backend has to read them back from the device. Here the page table has one row per
sequence of the batch (upstream indexes a request pool through ``req_pool_indices``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """Tokens to run through the model and where their K/V live.

    B = number of sequences, T = ``sum(extend_lens_cpu)`` new tokens in this pass, W = ``max(seq_lens)``.

    - ``input_ids``: int64 ``(T,)``, the new tokens of every sequence, concatenated in sequence order.
    - ``positions``: int64 ``(T,)``, absolute position of each new token in its sequence
      (``seq_lens[i] - extend_lens[i] + j`` for the j-th new token of sequence i).
    - ``out_cache_loc``: int64 ``(T,)``, the KV-pool slot each new token's K/V is written to.
    - ``req_to_token``: int64 ``(B, W)``; row i lists the slots of ALL tokens of sequence i (prefix and new)
      in position order, padded with slot 0 (the pool's padding page) after ``seq_lens[i]``; its entries
      ``seq_lens[i] - extend_lens[i] .. seq_lens[i] - 1`` equal that sequence's part of ``out_cache_loc``.
    - ``seq_lens``: int64 ``(B,)``, total tokens of each sequence after this pass (cached prefix + new).
    - ``cu_seqlens``: int64 ``(B+1,)``, offsets of each sequence's new tokens in the flat batch
      (``cu_seqlens[0] == 0``, ``cu_seqlens[B] == T``).
    - ``seq_lens_cpu``, ``extend_lens_cpu``: the same lengths as B host ints (extend length 1 for a decode).
    - ``layer_hook``: optional ``hook(layer_id)`` called before the attention of each layer (the scheduler
      passes the cache's ``wait_layer`` so KV load-back overlaps with compute).
    - ``seq_keys``: optional, one object per sequence that stands for the KV it owns (the scheduler passes
      each request's ``KVLease``), compared by identity across decode steps: a backend that keeps K/V
      between steps (the torch backend's staged decode) reuses them only for the same objects, so a new
      sequence on slots freed by another (a PD decode worker receives KV without a forward pass) is never
      mistaken for it. None: only the slots and lengths are compared.
    - ``mm_embeds``: optional ``(rows int64 (M,), embeds (M, hidden))``: rows of the flat batch that are image
      tokens (their ``input_ids`` are pad values outside the vocabulary) and the embeddings they take instead
      of a token embedding (``engine/model/vlm/mm.py``); an embedding wider than the model's hidden size
      carries deepstack rows after it (added after the first decoder layers, Qwen3-VL).
    - ``mrope_positions``: optional int64 ``(3, T)`` M-RoPE (time, row, column) positions of the new tokens
      (``engine/model/vlm/mm.py``'s ``mrope_positions``); None: RoPE from ``positions`` (an M-RoPE model
      then uses ``positions`` for all three).

    Tensors live on the model's device. Raises ``ValueError`` when the lengths disagree.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_to_token: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    layer_hook: Callable[[int], None] | None = None
    seq_keys: tuple | None = None
    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    mrope_positions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        num_tokens = self.input_ids.shape[0]
        if not (self.positions.shape[0] == self.out_cache_loc.shape[0] == num_tokens):
            raise ValueError(
                f"input_ids ({num_tokens}), positions ({self.positions.shape[0]}) and out_cache_loc "
                f"({self.out_cache_loc.shape[0]}) must have the same length"
            )
        b = len(self.seq_lens_cpu)
        if not b or len(self.extend_lens_cpu) != b:
            raise ValueError("seq_lens_cpu and extend_lens_cpu must be non-empty and of equal length")
        if (
            self.seq_lens.shape != (b,)
            or self.cu_seqlens.shape != (b + 1,)
            or self.req_to_token.shape[0] != b
        ):
            raise ValueError(
                f"seq_lens {tuple(self.seq_lens.shape)}, cu_seqlens {tuple(self.cu_seqlens.shape)} and "
                f"req_to_token {tuple(self.req_to_token.shape)} do not fit {b} sequences"
            )
        if self.seq_keys is not None and len(self.seq_keys) != b:
            raise ValueError(f"{len(self.seq_keys)} seq_keys for {b} sequences")
        if sum(self.extend_lens_cpu) != num_tokens:
            raise ValueError(
                f"sum(extend_lens) = {sum(self.extend_lens_cpu)} but the batch has {num_tokens} tokens"
            )
        width = self.req_to_token.shape[1]
        for i, (seq_len, ext) in enumerate(zip(self.seq_lens_cpu, self.extend_lens_cpu, strict=True)):
            if not 0 < ext <= seq_len <= width:
                raise ValueError(
                    f"sequence {i}: need 0 < extend_len ({ext}) <= seq_len ({seq_len}) <= req_to_token "
                    f"width ({width})"
                )

    @property
    def batch_size(self) -> int:
        """Number of sequences B."""
        return len(self.seq_lens_cpu)

    @property
    def is_decode(self) -> bool:
        """True when every sequence adds exactly one token."""
        return all(e == 1 for e in self.extend_lens_cpu)

    def req_slots(self, i: int) -> torch.Tensor:
        """Slots ``(seq_lens[i],)`` of every token of sequence ``i`` (a view of ``req_to_token``)."""
        return self.req_to_token[i, : self.seq_lens_cpu[i]]

    @classmethod
    def for_decode(
        cls,
        last_token_ids: Sequence[int],
        req_slots: Sequence[torch.Tensor],
        layer_hook: Callable[[int], None] | None = None,
        device: str | torch.device = "cpu",
        seq_keys: Sequence | None = None,
    ) -> ForwardBatch:
        """A decode step: one new token per sequence (``last_token_ids[i]``, whose slot is the last of
        ``req_slots[i]``; ``seq_keys`` as in the class docstring). Same batch as
        ``from_sequences([[t] for t in last_token_ids], req_slots)``, built with a fixed number of tensor ops
        whatever the batch size (one padded copy of the slot lists; the positions, ``out_cache_loc`` and
        offsets are derived from the lengths as tensors)."""
        device = torch.device(device)
        seq_lens = [int(s.shape[0]) for s in req_slots]
        if len(last_token_ids) != len(seq_lens) or not seq_lens:
            raise ValueError(f"{len(last_token_ids)} tokens for {len(seq_lens)} slot lists")
        table = torch.nn.utils.rnn.pad_sequence(list(req_slots), batch_first=True).to(device)
        lens = torch.tensor(seq_lens, dtype=torch.long).to(device)
        positions = lens - 1
        rows = torch.arange(len(seq_lens), dtype=torch.long, device=device)
        return cls(
            torch.tensor(list(last_token_ids), dtype=torch.long).to(device),
            positions,
            table[rows, positions],
            table,
            lens,
            torch.arange(len(seq_lens) + 1, dtype=torch.long, device=device),
            seq_lens,
            [1] * len(seq_lens),
            layer_hook,
            None if seq_keys is None else tuple(seq_keys),
        )

    @classmethod
    def from_sequences(
        cls,
        new_token_ids: Sequence[Sequence[int]],
        req_slots: Sequence[torch.Tensor],
        layer_hook: Callable[[int], None] | None = None,
        device: str | torch.device = "cpu",
    ) -> ForwardBatch:
        """Build a batch from each sequence's new tokens and the slots of all its tokens.

        ``new_token_ids[i]`` (length E_i >= 1) are the last E_i tokens of sequence i, whose slots are
        ``req_slots[i]`` (length S_i >= E_i, prefix first). Positions, ``out_cache_loc`` and the page table
        follow from these; the host data goes to ``device`` in one copy per tensor.
        """
        device = torch.device(device)
        extend_lens = [len(t) for t in new_token_ids]
        seq_lens = [int(s.shape[0]) for s in req_slots]
        if len(extend_lens) != len(seq_lens):
            raise ValueError(f"{len(extend_lens)} token lists for {len(seq_lens)} slot lists")
        table = torch.zeros((len(seq_lens), max(seq_lens, default=0)), dtype=torch.long)
        for i, s in enumerate(req_slots):
            table[i, : s.shape[0]] = s
        positions = torch.cat(
            [torch.arange(s - e, s, dtype=torch.long) for s, e in zip(seq_lens, extend_lens, strict=True)]
        )
        out_cache_loc = torch.cat(
            [table[i, s - e : s] for i, (s, e) in enumerate(zip(seq_lens, extend_lens, strict=True))]
        )
        input_ids = torch.tensor([t for ids in new_token_ids for t in ids], dtype=torch.long)
        cu_seqlens = torch.tensor([0, *extend_lens], dtype=torch.long).cumsum(0)
        return cls(
            input_ids.to(device),
            positions.to(device),
            out_cache_loc.to(device),
            table.to(device),
            torch.tensor(seq_lens, dtype=torch.long, device=device),
            cu_seqlens.to(device),
            seq_lens,
            extend_lens,
            layer_hook,
        )
