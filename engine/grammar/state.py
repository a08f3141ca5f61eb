"""One request's grammar matcher, and the batch hook that masks logits before sampling."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr


class GrammarState:
    """The matcher of one constrained request (scheduler thread only).

    Built from a compiled grammar when the request is created; on a PD decode worker it is rebuilt from the
    first token P sampled (``accept`` of that token), so D continues the same grammar.
    """

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False when the grammar does not allow it (the request must end)."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        """The grammar has accepted a stop token: nothing more may follow."""
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 ``(B, ceil(vocab / 32))``)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)


def apply_vocab_masks(logits: torch.Tensor, grammars: Sequence[GrammarState | None]) -> torch.Tensor:
    """Set every token a row's grammar forbids to ``-inf``; ``logits`` ``(B, vocab)``, ``grammars`` one entry
    per row (None: unconstrained). Returns ``logits`` unchanged when no row is constrained, else a float32
    tensor on the same device (masked in place when ``logits`` already is float32)."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab)
    for i in rows:
        grammars[i].fill(bitmask, i)
    logits = logits.float()
    # xgrammar's "auto" picks a compiled torch path on the CPU (~20 ms per call here); its C++ kernel: ~10 us
    backend = "cpu" if logits.device.type == "cpu" else "auto"
    xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device), vocab_size=vocab, indices=rows, backend=backend
    )
    return logits
