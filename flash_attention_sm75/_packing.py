"""Device-side helpers of the varlen and KV-cache doors (``fa2.py``): checks of packed-sequence
metadata and page tables, and the rows that gather a paged cache.

* :func:`check_cu_seqlens`: the check every varlen call makes before the varlen op
  (``torch.ops.flash_attention_sm75.varlen_fwd``, which takes the packed tokens as they are and
  reads ``cu_seqlens`` without checking them against ``max_seqlen``): offsets non-decreasing,
  inside the packed tensor, no sequence longer than the ``max_seqlen`` passed;
* :func:`check_block_table` / :func:`paged_rows`: paged keys (``block_table``), gathered into
  rows for the varlen op (``flash_attn_varlen_func``: one stretch of ``max_seqlen_k`` rows per
  sequence, its length as ``seqused_k``) and into (right-aligned) padded rows for the padded op
  (``flash_attn_with_kvcache``).

Everything here is built on the device (no ``.item()``, no host synchronisation); the sizes are
the host integers the caller passes. Invalid values (a length above the declared maximum,
decreasing offsets, offsets past the packed tensor, a block index outside the cache) are caught
by a device-side check (:func:`check_on_device`): ``ValueError`` on the CPU, a device-side
assertion on CUDA (``RuntimeError`` on the CPU in compiled graphs), never a silently wrong
result.
"""
from __future__ import annotations

import torch

__all__ = ["check_block_table", "check_cu_seqlens", "check_on_device", "paged_rows",
           "shown"]


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


def shown(n) -> str:
    """``n`` (a size) as a :func:`check_on_device` message shows it: its value, except while
    torch.compile traces. The message is built on every call, and formatting a size that the
    graph keeps symbolic (dynamic shapes) would specialise the graph to its value: one
    recompilation per size until the recompile limit (an error under ``fullgraph=True``)."""
    if torch.compiler.is_compiling():
        return "not shown under torch.compile"
    return str(n)


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
        f"ending at <= the number of packed tokens ({shown(total)}), with no sequence longer "
        f"than the max_seqlen passed ({shown(max_seqlen)})"))
    return lengths


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
        f"{shown(num_blocks)}) for every page that holds keys (the first ceil(length / "
        f"page_block_size = {shown(page_size)}) entries of each row), got one outside"))


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

