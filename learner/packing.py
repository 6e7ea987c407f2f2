"""Sequence packing for the policy's forward: a batch's sequences share rows instead of each
being right-padded to the widest one (docs/architecture.md, "Sequence packing").

A padded batch computes every layer on B x L positions, padding included; a packed one on
R x W, where rows hold several sequences back to back and each sequence's position ids
restart at 0. transformers' causal LMs read restarting position ids, with no attention mask,
as packed sequences and let a token attend only within its own sequence (flash-attention's
varlen kernels, or a block-diagonal mask for sdpa/eager); `packs_like_padding` checks that a
model does before the learner relies on it. The forward's outputs are mapped back to the
padded layout by `PackedRows.index`, so every loss and prepare stage keeps working on [B, L-1].

Rows are filled first-fit decreasing (longest sequence first, into the first row with room).
The row width W is the batch's widest sequence or twice it, whichever costs less under a
per-position cost of (linear work + W x attention work per key), from the model's widths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sluice.weight_sync.source import unwrap

WIDTHS = (1, 2)  # row widths tried, in multiples of the widest sequence


@dataclass(frozen=True)
class PackedRows:
    input_ids: torch.Tensor  # [R, W] sequences back to back, the tail of a row pad_id
    position_ids: torch.Tensor  # [R, W] 0.. within each sequence; every tail position 0
    index: torch.Tensor  # [B, L-1] flat position in R x W of each padded target position

    def to(self, device: torch.device) -> PackedRows:
        return PackedRows(*(t.to(device) for t in (self.input_ids, self.position_ids, self.index)))


def first_fit(lengths: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(row, offset) of each sequence and the row count: first-fit decreasing into rows of
    `width` positions (ties in batch order: the same batch always packs the same way)."""
    row = np.empty(len(lengths), dtype=np.int64)
    offset = np.empty(len(lengths), dtype=np.int64)
    free: list[int] = []  # room left in each row
    sizes = lengths.tolist()
    for i in np.argsort(-lengths, kind="stable").tolist():
        n = sizes[i]
        r = 0
        while r < len(free) and free[r] < n:
            r += 1
        if r == len(free):
            free.append(width)
        row[i], offset[i] = r, width - free[r]
        free[r] -= n
    return row, offset, len(free)


def attention_weight(model: torch.nn.Module) -> float:
    """Attention work per key against a position's linear work, from the model's widths
    (Llama-like: 4d^2 + 3d*ffn multiply-adds per position, 2d per key); 0 when unknown."""
    config = getattr(unwrap(model), "config", None)
    d = getattr(config, "hidden_size", None)
    ffn = getattr(config, "intermediate_size", None)
    if not isinstance(d, int) or not isinstance(ffn, int):
        return 0.0
    return 2.0 / (4 * d + 3 * ffn)


def plan(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_id: int, attn_weight: float
) -> PackedRows | None:
    """The packed layout of a right-padded batch, or None where packing would not cost less than
    the padding does (positions, each with its attention work)."""
    lengths = attention_mask.sum(-1).cpu().numpy()
    batch, width = input_ids.shape
    if lengths.min() == width:  # every row full
        return None
    total = int(lengths.sum())
    best = None  # (cost, width, row, offset, rows)
    for w in (width * k for k in WIDTHS):
        if best is not None and -(-total // w) * w * (1 + attn_weight * w) >= best[0]:
            continue  # even rows filled to the last position would cost more
        row, offset, rows = first_fit(lengths, w)
        cost = rows * w * (1 + attn_weight * w)
        if best is None or cost < best[0]:
            best = (cost, w, row, offset, rows)
    assert best is not None
    cost, w, row, offset, rows = best
    if cost >= batch * width * (1 + attn_weight * width):
        return None
    return _layout(input_ids, lengths, row, offset, rows, w, pad_id)


def _layout(
    input_ids: torch.Tensor,
    lengths: np.ndarray,
    row: np.ndarray,
    offset: np.ndarray,
    rows: int,
    w: int,
    pad_id: int,
) -> PackedRows:
    """Built in numpy on the host (a few vectorised ops over the batch), then moved."""
    src = input_ids.cpu().numpy()
    col = np.arange(src.shape[1])
    start = row * w + offset  # flat start of each sequence
    dest = start[:, None] + col[None, :]  # [B, L]
    filled = col[None, :] < lengths[:, None]
    flat = dest[filled]
    ids = np.full(rows * w, pad_id, dtype=src.dtype)
    ids[flat] = src[filled]
    pos = np.zeros(rows * w, dtype=np.int64)
    pos[flat] = (col[None, :] + np.zeros_like(dest))[filled]
    # a target position past its sequence's end points at the sequence's start: masked anyway
    index = np.where(filled[:, 1:], dest[:, :-1], start[:, None])
    packed = PackedRows(*(torch.from_numpy(a) for a in (ids.reshape(rows, w), pos.reshape(rows, w), index)))
    return packed.to(input_ids.device) if input_ids.device.type != "cpu" else packed


def packs_like_padding(
    model: torch.nn.Module, pad_id: int, vocab: int, device: torch.device, tolerance: float = 1e-3
) -> bool:
    """Whether `model`'s forward on packed rows gives the padded forward's logits: three
    sequences in one row against the same three right-padded (fails, rather than raising,
    for a model whose forward takes no position ids or attends across sequences)."""
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 3, 4]
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    padded = torch.full((3, 5), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        padded[i, : len(s)] = s
    mask = (torch.arange(5)[None] < torch.tensor(lengths)[:, None]).long()
    packed = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    training = model.training
    model.eval()  # no dropout: the two forwards must be comparable
    try:
        with torch.no_grad():
            a = model(input_ids=padded.to(device), attention_mask=mask.to(device), **no_kv_cache(model))
            b = model(input_ids=packed.to(device), position_ids=positions.to(device), **no_kv_cache(model))
    except (TypeError, ValueError, RuntimeError):
        return False
    finally:
        model.train(training)
    a, b = a.logits.float()[mask.to(device).bool()], b.logits.float()[0]
    return bool(((a - b).abs().max() / a.abs().max().clamp(min=1.0)) < tolerance)


def no_kv_cache(model: torch.nn.Module) -> dict[str, bool]:
    """`use_cache=False` for a model whose config has that switch (transformers' causal LMs,
    which default to building a KV cache in every forward): a scoring forward decodes nothing
    after it, the cache cost ~2-3% of the quickstart model's forward and backward, and with a
    cache transformers does not read restarting position ids as packed sequences."""
    config = getattr(unwrap(model), "config", None)
    return {"use_cache": False} if getattr(config, "use_cache", None) is not None else {}
