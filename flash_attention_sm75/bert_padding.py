"""Padding helpers with flash-attn 2's ``flash_attn.bert_padding`` API, in plain torch ops.

Move tokens between a padded batch ``(batch, seqlen, ...)`` and the packed ``(total_tokens,
...)`` layout of the varlen functions (:mod:`flash_attention_sm75.fa2`). Every function is
differentiable (indexing and out-of-place ``index_put``) and allocates only its result. The
``flash_attn`` drop-in re-exports this module as ``flash_attn.bert_padding``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._rules import PREFIX

__all__ = [
    "index_first_axis",
    "index_put_first_axis",
    "pad_input",
    "unpad_input",
    "unpad_input_for_concatenated_sequences",
]


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``input[indices]`` for ``input`` of at least 2 dimensions and 1-D integer ``indices``
    (the rows to take along the first axis)."""
    if not isinstance(input, torch.Tensor) or input.dim() < 2:
        raise ValueError(f"{PREFIX}index_first_axis: input must have at least 2 dimensions, got "
                         f"{getattr(input, 'shape', type(input).__name__)}")
    return input[indices]


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor,
                         first_axis_dim: int) -> torch.Tensor:
    """A zero tensor of shape ``(first_axis_dim, *values.shape[1:])`` whose rows ``indices`` are
    ``values`` (the inverse of :func:`index_first_axis`)."""
    if not isinstance(values, torch.Tensor) or values.dim() < 2 or indices.dim() != 1:
        raise ValueError(f"{PREFIX}index_put_first_axis: values must have at least 2 dimensions "
                         f"and indices 1")
    out = values.new_zeros((first_axis_dim,) + tuple(values.shape[1:]))
    return out.index_put((indices,), values)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                unused_mask: Optional[torch.Tensor] = None):
    """Pack the tokens a mask selects.

    Parameters
    ----------
    hidden_states : (batch, seqlen, ...)
    attention_mask : (batch, seqlen), bool or int; nonzero = a token.
    unused_mask : (batch, seqlen), optional; nonzero = a slot that is allocated but unused (it is
        packed too, and counted in ``cu_seqlens`` but not in ``seqused``).

    Returns
    -------
    (hidden_states, indices, cu_seqlens, max_seqlen_in_batch, seqused)
        ``(total, ...)`` packed tokens; their int64 positions in the flattened ``batch *
        seqlen``; int32 ``(batch + 1,)`` offsets; the longest sequence as a Python int (one
        host synchronisation); int32 ``(batch,)`` counts of ``attention_mask`` alone. (flash-attn
        2.7+ returns these five; callers written for four can take ``*_`` for the rest.)
    """
    used = attention_mask != 0
    selected = used if unused_mask is None else used | (unused_mask != 0)
    seqlens = selected.sum(dim=-1, dtype=torch.int32)
    seqused = used.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(selected.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape((-1,) + tuple(hidden_states.shape[2:]))
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen, seqused


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor,
                                           attention_mask_in_length: torch.Tensor):
    """Pack rows that each hold several concatenated samples.

    ``attention_mask_in_length`` ``(batch, seqlen)``, int: row ``b`` lists the lengths of the
    samples concatenated at the start of row ``b`` (its nonzero entries, in order; zeros
    elsewhere). Every sample becomes its own sequence.

    Returns ``(hidden_states (total, ...), indices, cu_seqlens (int32), max_seqlen_in_batch)``.
    """
    lengths = attention_mask_in_length
    seqlen = lengths.shape[-1]
    row_tokens = lengths.sum(dim=-1)
    selected = torch.arange(seqlen, device=lengths.device).view(1, -1) < row_tokens.view(-1, 1)
    flat_lengths = lengths.flatten()
    seqlens = flat_lengths[flat_lengths != 0].to(torch.int32)
    indices = torch.nonzero(selected.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape((-1,) + tuple(hidden_states.shape[2:]))
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int,
              seqlen: int) -> torch.Tensor:
    """The inverse of :func:`unpad_input`: packed ``(total, ...)`` tokens back to a zero-padded
    ``(batch, seqlen, ...)`` at their ``indices`` in the flattened ``batch * seqlen``."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.view((batch, seqlen) + tuple(hidden_states.shape[1:]))
