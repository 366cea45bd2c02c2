"""Packed (varlen) sequences: the device-side check of ``cu_seqlens`` that every varlen call
makes (:func:`check_cu_seqlens`), and packed <-> the op's padded BSHD batches, with device-side
indices, for the calls the varlen op does not serve (paged ``block_table`` keys).

The varlen op (``torch.ops.flash_attention_sm75.varlen_fwd``) takes the packed tokens as they
are; the rest of this module is for the padded op. The padded op (docs/CONTRACT.md) takes
padded ``(batch, seqlen, heads, head_dim)`` tensors, a key range
``[leftpad_k[b], seqused_k[b])`` per batch entry and ONE causal offset for the whole call
(key ``j`` is visible to query row ``r`` iff ``j <= r + seqlen_k - seqlen_q``). flash-attn's
varlen functions want bottom-right causal masking *per sequence*: query ``i`` of sequence ``b``
sees key ``j`` iff ``j <= i + len_k[b] - len_q[b]``. Both agree when every sequence is
**right-aligned** in its padded row: queries of sequence ``b`` at rows ``[Mq - len_q[b], Mq)``,
keys at rows ``[Mk - len_k[b], Mk)``, ``leftpad_k[b] = Mk - len_k[b]``, ``seqused_k[b] = Mk``
(``Mq``, ``Mk``: the padded lengths). Row ``r = Mq - len_q + i`` then sees key row
``Mk - len_k + j`` iff ``j <= i + len_k - len_q``: flash-attn's rule, exactly.

Everything here is built on the device from ``cu_seqlens`` (no ``.item()``, no host
synchronisation); the padded lengths are the host integers the caller passes
(``max_seqlen_q`` / ``max_seqlen_k``). Invalid ``cu_seqlens`` (a length above the declared
maximum, decreasing offsets, offsets past the packed tensor) are caught by a device-side check
(:func:`check_on_device`): ``ValueError`` on the CPU, a device-side assertion on CUDA
(``RuntimeError`` on the CPU in compiled graphs), never a silently wrong result. Packing uses
out-of-place ``index_put`` and unpacking advanced indexing, so autograd differentiates both (their backward passes are gathers and scatters with one source
per destination: exact, and deterministic in value).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["SeqLayout", "check_block_table", "check_cu_seqlens", "check_on_device", "pack", "paged_rows", "seq_layout",
           "unpack"]


def check_on_device(ok: torch.Tensor, message: str) -> None:
    """Fail unless the 0-d bool tensor ``ok`` is True, without a host synchronisation on CUDA.

    CPU: ``ValueError(message)`` right away. CUDA (and any other device): ``torch._assert_async``,
    a device-side assertion that surfaces at the next synchronisation as a CUDA error (and, as
    every device assertion, leaves the CUDA context unusable): the price of checking values that
    live on the GPU without waiting for them. It is ordered on the stream before the work
    enqueued after it, so writes enqueued after the check do not run when it fails (also in a
    captured CUDA graph, where it is one more node).

    While torch.compile traces (also on the CPU), ``bool(ok)`` would be a data-dependent branch
    (a graph break, an error under ``fullgraph=True``): the traced graph keeps
    ``torch._assert_async`` instead, which fails at run time with ``RuntimeError(message)`` on
    the CPU (inductor and the eager backends alike) and a device-side assertion on CUDA.
    """
    if ok.device.type != "cpu" or torch.compiler.is_compiling():
        torch._assert_async(ok, message)
    elif not bool(ok):
        raise ValueError(message)


class SeqLayout(NamedTuple):
    """Where each packed token goes in the right-aligned padded batch.

    ``dst[t]`` is the row of token ``t`` in the flattened ``(batch * max_seqlen)`` padded
    tensor, or ``batch * max_seqlen`` (a dummy row, dropped) for a token that belongs to no
    sequence (before ``cu_seqlens[0]`` or from ``cu_seqlens[-1]`` on); ``valid[t]`` says which.
    ``lengths[b]`` (int64) is the length of sequence ``b``."""

    dst: torch.Tensor
    valid: torch.Tensor
    lengths: torch.Tensor
    batch: int
    max_seqlen: int


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, max_seqlen: int,
                     name: str) -> torch.Tensor:
    """Check on the device (:func:`check_on_device`) that ``cu_seqlens`` (int, ``(batch + 1,)``)
    splits ``total`` packed tokens into sequences of at most ``max_seqlen``: offsets
    non-decreasing, starting at >= 0 and ending at <= ``total``. ``name`` is how the message
    calls ``cu_seqlens``. Returns the lengths (int64, ``(batch,)``). What the varlen op needs
    before it runs (a sequence longer than its ``max_seqlen`` is undefined there)."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    ok = (cu[0] >= 0) & (cu[-1] <= total)
    if cu_seqlens.shape[0] > 1:
        ok = ok & (lengths >= 0).all() & (lengths <= max_seqlen).all()
    check_on_device(ok, (
        f"flash_attention_sm75: {name} must be non-decreasing offsets starting at >= 0 and "
        f"ending at <= the number of packed tokens ({total}), with no sequence longer than "
        f"the max_seqlen passed ({max_seqlen})"))
    return lengths


def seq_layout(cu_seqlens: torch.Tensor, total: int, max_seqlen: int, name: str) -> SeqLayout:
    """The :class:`SeqLayout` of ``total`` packed tokens split by ``cu_seqlens`` (int32,
    ``(batch + 1,)``) into right-aligned rows of ``max_seqlen``; ``name`` is how error messages
    call ``cu_seqlens``. Checks them on the device first (:func:`check_cu_seqlens`)."""
    batch = cu_seqlens.shape[0] - 1
    lengths = check_cu_seqlens(cu_seqlens, total, max_seqlen, name)
    cu = cu_seqlens.to(torch.int64)
    t = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(cu[1:].contiguous(), t, right=True)  # sequence of token t; batch: none
    valid = (seq < batch) & (t >= cu[0])
    end = cu[(seq + 1).clamp(max=batch)]
    # token t of sequence s, which ends at `end`, goes to row s * M + (M - (end - t))
    dst = torch.where(valid, (seq + 1) * max_seqlen - end + t,
                      torch.full_like(t, batch * max_seqlen))
    return SeqLayout(dst, valid, lengths, batch, max_seqlen)


def pack(x: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
    """Packed ``(total, *rest)`` -> right-aligned padded ``(batch, max_seqlen, *rest)``, zeros in
    the padding (differentiable: the gradient of ``x`` is gathered back)."""
    rows = layout.batch * layout.max_seqlen
    buf = x.new_zeros((rows + 1,) + tuple(x.shape[1:]))
    buf = buf.index_put((layout.dst,), x)
    return buf[:rows].view((layout.batch, layout.max_seqlen) + tuple(x.shape[1:]))


def unpack(padded: torch.Tensor, layout: SeqLayout, fill: float = 0.0, dim: int = 0) -> torch.Tensor:
    """The inverse of :func:`pack` along dimension ``dim`` of ``padded`` (which holds the
    flattened ``batch * max_seqlen`` rows there): the packed rows, ``fill`` for tokens of no
    sequence."""
    rows = layout.batch * layout.max_seqlen
    shape = list(padded.shape)
    shape[dim] = layout.dst.shape[0]
    if rows == 0:
        return padded.new_full(shape, fill)
    idx = layout.dst.clamp(max=rows - 1)
    picked = padded[(slice(None),) * dim + (idx,)]
    keep = layout.valid.view((-1,) + (1,) * (padded.dim() - dim - 1))
    return torch.where(keep, picked, torch.full((), fill, dtype=picked.dtype,
                                                device=picked.device))


def check_block_table(block_table: torch.Tensor, lengths: torch.Tensor, page_size: int,
                      num_blocks: int) -> None:
    """Check on the device (:func:`check_on_device`) that every page holding keys is a block of
    the cache: ``0 <= block_table[b, c] < num_blocks`` for ``c * page_size < lengths[b]``. The
    other entries are not read for keys (flash-attn lets callers leave them unset, e.g. -1):
    :func:`paged_rows` clamps them."""
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    used = cols.view(1, -1) * page_size < lengths.view(-1, 1)
    ok = (((block_table >= 0) & (block_table < num_blocks)) | ~used).all()
    check_on_device(ok, (
        f"flash_attention_sm75: block_table must hold block indices in [0, num_blocks = "
        f"{num_blocks}) for every page that holds keys (the first ceil(length / "
        f"page_block_size = {page_size}) entries of each row), got one outside"))


def paged_rows(block_table: torch.Tensor, page_size: int, start: torch.Tensor,
               padded_len: int, num_blocks: int) -> tuple:
    """(block, offset) index pairs, each ``(batch, padded_len)`` int64, that gather a paged
    cache into padded rows: row ``r`` of batch entry ``b`` holds the sequence's logical position
    ``r - start[b]`` (clamped to 0 for the rows before ``start[b]``, which the key range hides),
    stored in block ``block_table[b, pos // page_size]`` at offset ``pos % page_size``.
    Block indices are clamped into ``[0, num_blocks)``: the rows of pages that hold no keys (whose
    entries :func:`check_block_table` does not require to be valid) are hidden by the key range,
    and must not index out of bounds."""
    r = torch.arange(padded_len, device=block_table.device)
    pos = (r.view(1, -1) - start.view(-1, 1)).clamp(min=0)
    col = (pos // page_size).clamp(max=max(block_table.shape[1] - 1, 0))
    blk = block_table.to(torch.int64).gather(1, col).clamp(0, max(num_blocks - 1, 0))
    return blk, pos % page_size

