"""ForwardBatch: one forward pass over a mixed batch of sequences (prefill chunks and decodes).

Follows SGLang's ``ForwardBatch`` in spirit (flat tokens, absolute positions, ``out_cache_loc``) with a
per-sequence list of token slots instead of a request-to-token table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """Tokens to run through the model and where their K/V live.

    B = number of sequences, T = ``sum(extend_lens)`` new tokens in this pass.

    - ``input_ids``: int64 ``(T,)``, the new tokens of every sequence, concatenated in sequence order.
    - ``positions``: int64 ``(T,)``, absolute position of each new token in its sequence
      (``seq_lens[i] - extend_lens[i] + j`` for the j-th new token of sequence i).
    - ``out_cache_loc``: int64 ``(T,)``, the KV-pool slot each new token's K/V is written to.
    - ``seq_lens``: B ints, total tokens of each sequence after this pass (cached prefix + new).
    - ``extend_lens``: B ints, new tokens of each sequence in this pass (1 for a decode).
    - ``req_slots``: B int64 tensors; ``req_slots[i]`` has shape ``(seq_lens[i],)`` and lists the slots of ALL
      tokens of sequence i (prefix and new) in position order, so its last ``extend_lens[i]`` entries equal
      that sequence's part of ``out_cache_loc``.
    - ``layer_hook``: optional ``hook(layer_id)`` called before the attention of each layer (the scheduler
      passes the cache's ``wait_layer`` so KV load-back overlaps with compute).

    Tensors live on the model's device. Raises ``ValueError`` when the lengths disagree.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens: list[int]
    extend_lens: list[int]
    req_slots: list[torch.Tensor]
    layer_hook: Callable[[int], None] | None = None

    def __post_init__(self) -> None:
        num_tokens = self.input_ids.shape[0]
        if not (self.positions.shape[0] == self.out_cache_loc.shape[0] == num_tokens):
            raise ValueError(
                f"input_ids ({num_tokens}), positions ({self.positions.shape[0]}) and out_cache_loc "
                f"({self.out_cache_loc.shape[0]}) must have the same length"
            )
        if not (len(self.seq_lens) == len(self.extend_lens) == len(self.req_slots)) or not self.seq_lens:
            raise ValueError("seq_lens, extend_lens and req_slots must be non-empty and of equal length")
        if sum(self.extend_lens) != num_tokens:
            raise ValueError(
                f"sum(extend_lens) = {sum(self.extend_lens)} but the batch has {num_tokens} tokens"
            )
        for i, (seq_len, ext, slots) in enumerate(
            zip(self.seq_lens, self.extend_lens, self.req_slots, strict=True)
        ):
            if not 0 < ext <= seq_len or slots.shape[0] != seq_len:
                raise ValueError(
                    f"sequence {i}: need 0 < extend_len ({ext}) <= seq_len ({seq_len}) == len(req_slots) "
                    f"({slots.shape[0]})"
                )

    @property
    def batch_size(self) -> int:
        """Number of sequences B."""
        return len(self.seq_lens)

    @property
    def is_decode(self) -> bool:
        """True when every sequence adds exactly one token."""
        return all(e == 1 for e in self.extend_lens)

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
        ``req_slots[i]`` (length S_i >= E_i, prefix first). Positions and ``out_cache_loc`` follow from these.
        """
        device = torch.device(device)
        slots = [s.to(device=device, dtype=torch.long) for s in req_slots]
        extend_lens = [len(t) for t in new_token_ids]
        seq_lens = [int(s.shape[0]) for s in slots]
        positions = torch.cat(
            [torch.arange(s - e, s, dtype=torch.long) for s, e in zip(seq_lens, extend_lens, strict=True)]
        ).to(device)
        out_cache_loc = torch.cat([s[s.shape[0] - e :] for s, e in zip(slots, extend_lens, strict=True)])
        input_ids = torch.tensor([t for ids in new_token_ids for t in ids], dtype=torch.long, device=device)
        return cls(input_ids, positions, out_cache_loc, seq_lens, extend_lens, slots, layer_hook)
