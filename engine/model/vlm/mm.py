"""Image tokens in a prompt and their embeddings in a batch.

A chat template writes the image token once per image; ``expand_prompt`` replaces each with as many
copies of the image's pad value as the image has tokens (upstream's ``pad_input_ids``: ids derived from the
image's content hash), so the prefix cache keys image tokens by content: the same image at the same place
matches, a different one diverges at its first image token.

M-RoPE (Qwen3-VL): a text token's three positions (time, row, column) are all its index plus a shift; an
image's tokens, laid out row by row over a ``rows x cols`` grid, take ``(s, s + row, s + col)`` where ``s``
is the position the image's first token would have as text, and the text after it continues at
``s + max(rows, cols)``, so every image shifts what follows by ``max(rows, cols) - rows * cols``
(transformers' ``get_rope_index``). ``mrope_positions`` computes them for any range of a prompt (a prefill
chunk after a cache hit, one decode token) from the items alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class MMItem:
    """One image in a prompt: its tokens are ``offset .. offset + length - 1``, all ``pad_value``;
    ``grid``: ``(rows, cols)`` of those tokens for M-RoPE (None: plain positions); ``embeds``
    ``(length, embed_dim)`` are set before its first prefill chunk (from the local vision tower or an
    encoder worker)."""

    offset: int
    length: int
    pad_value: int
    digest: str
    embeds: torch.Tensor | None = None
    grid: tuple[int, int] | None = None


@dataclass(frozen=True)
class ImageSlot:
    """What an image contributes to a prompt: its pad id, digest, token count and M-RoPE grid (or None)."""

    pad_value: int
    digest: str
    length: int
    grid: tuple[int, int] | None = None


def expand_prompt(
    ids: Sequence[int], image_token_id: int, images: Sequence[ImageSlot]
) -> tuple[list[int], list[MMItem]]:
    """``ids`` with the k-th image token replaced by ``images[k].length`` x ``images[k].pad_value``, and
    the items. Raises ``ValueError`` when the prompt has a different number of image tokens than there are
    images.
    """
    placeholders = sum(1 for t in ids if t == image_token_id)
    if placeholders != len(images):
        raise ValueError(
            f"the prompt has {placeholders} image placeholders but {len(images)} images were given"
        )
    out: list[int] = []
    items: list[MMItem] = []
    for t in ids:
        if t != image_token_id:
            out.append(t)
            continue
        slot = images[len(items)]
        items.append(MMItem(len(out), slot.length, slot.pad_value, slot.digest, grid=slot.grid))
        out.extend([slot.pad_value] * slot.length)
    return out, items


def mrope_positions(ranges: Sequence[tuple[Sequence[MMItem], int, int]]) -> torch.Tensor | None:
    """M-RoPE positions int64 ``(3, T)`` of prompt positions ``[start, end)`` of each sequence (in batch
    order, with its items; see the module docstring), or None when no item has a grid (every position is
    then its index, as without M-RoPE)."""
    if not any(item.grid is not None for items, _, _ in ranges for item in items):
        return None
    out = []
    for items, start, end in ranges:
        idx = torch.arange(start, end)
        pos = idx.expand(3, -1).clone()
        for item in sorted(items, key=lambda i: i.offset):
            if item.grid is None:
                continue
            rows, cols = item.grid
            inside = (idx >= item.offset) & (idx < item.offset + item.length)
            if bool(inside.any()):
                j = idx[inside] - item.offset
                first = pos[0, inside] - j
                pos[1, inside] = first + j // cols
                pos[2, inside] = first + j % cols
                pos[0, inside] = first
            pos[:, idx >= item.offset + item.length] += max(rows, cols) - item.length
        out.append(pos)
    return torch.cat(out, dim=1)


def batch_embeds(
    ranges: Sequence[tuple[Sequence[MMItem], int, int]],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows of the flat batch that are image tokens and their embeddings, for sequences extending prompt
    positions ``[start, end)`` (in batch order, with their items). None when no image token is computed.

    Returns ``(rows int64 (M,), embeds (M, embed_dim))``. Raises ``ValueError`` for an item without
    embeddings.
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
