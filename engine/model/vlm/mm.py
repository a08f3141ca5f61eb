"""Image tokens in a prompt and their embeddings in a batch.

A chat template writes the image token once per image; ``expand_prompt`` replaces each with
``tokens_per_image`` copies of the image's pad value (upstream's ``pad_input_ids``: ids derived from the
image's content hash), so the prefix cache keys image tokens by content: the same image at the same place
matches, a different one diverges at its first image token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class MMItem:
    """One image in a prompt: its tokens are ``offset .. offset + length - 1``, all ``pad_value``;
    ``embeds`` ``(length, text_hidden)`` are set before its first prefill chunk (from the local vision tower
    or an encoder worker)."""

    offset: int
    length: int
    pad_value: int
    digest: str
    embeds: torch.Tensor | None = None


def expand_prompt(
    ids: Sequence[int], image_token_id: int, pads: Sequence[tuple[int, str]], tokens_per_image: int
) -> tuple[list[int], list[MMItem]]:
    """``ids`` with the k-th image token replaced by ``tokens_per_image`` x ``pads[k][0]``, and the items.

    ``pads``: ``(pad_value, digest)`` per image, in prompt order. Raises ``ValueError`` when the prompt has
    a different number of image tokens than there are images.
    """
    placeholders = sum(1 for t in ids if t == image_token_id)
    if placeholders != len(pads):
        raise ValueError(
            f"the prompt has {placeholders} image placeholders but {len(pads)} images were given"
        )
    out: list[int] = []
    items: list[MMItem] = []
    for t in ids:
        if t != image_token_id:
            out.append(t)
            continue
        pad, digest = pads[len(items)]
        items.append(MMItem(len(out), tokens_per_image, pad, digest))
        out.extend([pad] * tokens_per_image)
    return out, items


def batch_embeds(
    ranges: Sequence[tuple[Sequence[MMItem], int, int]],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows of the flat batch that are image tokens and their embeddings, for sequences extending prompt
    positions ``[start, end)`` (in batch order, with their items). None when no image token is computed.

    Returns ``(rows int64 (M,), embeds (M, hidden))``. Raises ``ValueError`` for an item without embeddings.
    """
    rows: list[torch.Tensor] = []
    embeds: list[torch.Tensor] = []
    base = 0
    for items, start, end in ranges:
        for item in items:
            lo, hi = max(start, item.offset), min(end, item.offset + item.length)
            if lo >= hi:
                continue
            if item.embeds is None:
                raise ValueError(f"image {item.digest[:12]} has no embeddings")
            rows.append(torch.arange(base + lo - start, base + hi - start))
            embeds.append(item.embeds[lo - item.offset : hi - item.offset])
        base += end - start
    if not rows:
        return None
    return torch.cat(rows), torch.cat(embeds)
