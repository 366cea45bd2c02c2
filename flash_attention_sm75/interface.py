"""Direct FlashAttention API: :func:`flash_attn_func` (BSHD) and :func:`flash_attention_forward` (BHSD).

Both ask the rulebook (``_rules.check_inputs``) and call ``torch.ops.flash_attention_sm75.fwd``
(see docs/CONTRACT.md) through ``_ops.call_fwd``, so bad input raises ``ValueError`` before any
kernel launch. Both use the FlashAttention (bottom-right) causal alignment. For torch
SDPA semantics (top-left causal, fallback for unsupported input) use
:func:`flash_attention_sm75.scaled_dot_product_attention`.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from . import _ops, _rules

__all__ = ["flash_attn_func", "flash_attention_forward"]


def _as_float(softmax_scale: object) -> Optional[float]:
    # A validated scale may be any real number (numpy scalars included); the op takes a float.
    return None if softmax_scale is None else float(softmax_scale)


def _window_args(window_size) -> Tuple[int, int]:
    # A validated window (the rulebook) as the op's two ints (numpy integers included).
    return int(window_size[0]), int(window_size[1])


def _softcap_arg(softcap) -> float:
    # A validated softcap (the rulebook) as the op's float (numpy scalars and ints included).
    return softcap if type(softcap) is float else float(softcap)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    return_lse: bool = False,
    *,
    dropout_p: float = 0.0,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention with the FlashAttention-2 algorithm, BSHD layout (FlashAttention's API).

    Computes ``softmax(softmax_scale * q @ k^T + mask) @ v`` per batch entry and head without
    materializing the attention matrix. Argument names follow the ``flash_attn`` package and the
    positional order is FlashAttention-3's ``(q, k, v, softmax_scale, causal)``, so code using
    ``flash_attn.flash_attn_func(q, k, v, softmax_scale=..., causal=...)`` can switch by
    changing the import. FlashAttention-2's order has ``dropout_p`` before ``softmax_scale``:
    pass ``softmax_scale`` and ``causal`` by keyword when porting such calls. ``window_size``
    (a sliding window), ``softcap`` (logit soft-capping), ``alibi_slopes`` (ALiBi) and
    ``dropout_p`` (attention dropout, keyword-only here) are computed as in FlashAttention-2.

    Parameters
    ----------
    q : torch.Tensor
        Queries, shape ``(batch_size, seqlen_q, num_heads, head_dim)``, dtype ``torch.float16``.
        CUDA tensor (compute capability >= 7.5), or CPU tensor (computed by a reference
        implementation: forward in float64, backward in float32; it materializes the
        seqlen_q x seqlen_k scores: O(N^2) memory and far slower than torch's SDPA on CPU; it is
        meant for tests and portability). Any strides with ``stride(-1) == 1``; on CUDA the data pointer must be
        16-byte aligned and the batch, sequence and head strides divisible by 8 elements (where
        that dimension has more than one entry).
    k : torch.Tensor
        Keys, shape ``(batch_size, seqlen_k, num_heads_k, head_dim)``, same dtype, device and
        stride requirements as ``q``. ``num_heads`` must be divisible by ``num_heads_k``
        (grouped-query / multi-query attention, see Notes). ``head_dim`` must be a multiple of 8
        from 8 to 256 (``_rules.HEAD_DIMS``).
    v : torch.Tensor
        Values, same shape as ``k``, same dtype, device and stride requirements as ``q``.
    softmax_scale : float, optional
        Multiplier of ``q @ k^T`` before the softmax: a real number (Python or numpy scalar) in
        ``[1.18e-38, 1.07e26]``, the range in which no float32 score can overflow for float16
        inputs. Default ``None`` means
        ``1 / sqrt(head_dim)``.
    causal : bool, optional
        Default ``False``. If ``True``, apply a causal mask aligned to the **bottom-right**
        corner of the attention matrix (FlashAttention convention, see Notes): query ``i`` sees
        key ``j`` iff ``j <= i + seqlen_k - seqlen_q``.
    return_lse : bool, optional
        Default ``False``. If ``True``, also return the softmax log-sum-exp.
    dropout_p : float, optional, keyword-only
        Attention dropout probability in ``[0, 1)`` (FlashAttention-2's and torch's semantics):
        each element of the softmax's probabilities is kept with probability ``1 - dropout_p``
        and scaled by ``1 / (1 - dropout_p)``, the others are zeroed, before ``@ v``; the LSE
        is that of the undropped scores. The mask comes from a counter-based generator
        (Philox4x32-7) seeded by torch's default CUDA generator (CPU tensors: the CPU
        generator), so ``torch.manual_seed`` reproduces a call bitwise and CUDA-graph replays
        draw new masks; the backward regenerates the same mask (every ``head_dim``). Default
        ``0.0``: none. Under torch.compile the graph draws the seed pair (``torch.randint``:
        two calls never share a mask, a recomputed forward reuses its draw); ``ValueError``
        there with ``torch._functorch.config.activation_memory_budget < 1`` (the partitioner
        may recompute the draw in the backward, pytorch/pytorch#190758).
    window_size : tuple of int, optional, keyword-only
        Sliding window ``(left, right)`` as in FlashAttention-2: query ``i`` sees key ``j`` only
        if ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right`` (the
        bottom-right alignment of ``causal``); ``-1`` leaves that side unbounded. Each entry is
        an int, ``-1`` or ``>= 0``. With ``causal=True`` the right side is 0. Default
        ``(-1, -1)``: no window. Key tiles outside every row's window are skipped, so the cost
        follows the window, not ``seqlen_k``.
    softcap : float, optional, keyword-only
        Logit soft-capping (FlashAttention-2's, Gemma 2's ``attn_logit_softcapping``): with
        ``softcap > 0`` each scaled score ``s = softmax_scale * q_i . k_j`` becomes
        ``softcap * tanh(s / softcap)`` before the mask and the softmax (and the backward
        carries the tanh's derivative). A real number, finite and ``>= 0``; default ``0.0``:
        off. (FlashAttention-2 also reads negative values as off; here they raise.)
    alibi_slopes : torch.Tensor, optional, keyword-only
        ALiBi (FlashAttention-2's): ``float32`` of shape ``(num_heads,)`` or
        ``(batch_size, num_heads)``, last dimension contiguous, on ``q``'s device. Adds
        ``-slope[h] * |i + seqlen_k - seqlen_q - j|`` to the (soft-capped) score of query ``i``
        and key ``j`` in head ``h`` (bottom-right aligned like ``causal``, with or without
        ``causal``). No gradient flows to the slopes: slopes that require grad raise
        ``ValueError`` while grad mode is on (pass ``alibi_slopes.detach()``). Default
        ``None``: no ALiBi.

    Returns
    -------
    out : torch.Tensor
        Shape ``(batch_size, seqlen_q, num_heads, head_dim)``, ``torch.float16``, contiguous,
        on the device of ``q``. Returned alone when ``return_lse`` is ``False``.
    (out, softmax_lse) : tuple of torch.Tensor
        When ``return_lse`` is ``True``. ``softmax_lse`` has shape
        ``(batch_size, num_heads, seqlen_q)``, ``torch.float32``, contiguous: the natural log of
        ``sum_j exp(score_ij)`` over the keys row ``i`` sees (``score_ij``: the scaled score
        after ``softcap`` and ``alibi_slopes``).

        Zero sizes are valid (``batch_size``, ``seqlen_q``, ``seqlen_k`` or ``num_heads`` with
        ``num_heads_k`` of 0): the result has the shapes above, empty, or with
        ``seqlen_k == 0`` an ``out`` of zeros and a ``softmax_lse`` of ``-inf`` (query rows that
        see no key); the backward gives zero gradients. Nothing is launched.

    Raises
    ------
    ValueError
        If an input is invalid: sparse (not strided), not 4-D, not float16, on different
        devices, last
        dimension not contiguous, misaligned on CUDA, mismatched batch size or head_dim,
        ``k``/``v`` shapes differ, ``head_dim`` not a multiple of 8 in [8, 256], ``num_heads`` not divisible by
        ``num_heads_k`` (``num_heads_k == 0`` with ``num_heads >= 1`` included),
        ``softmax_scale`` not a real number in ``[1.18e-38, 1.07e26]``, or
        ``causal`` /
        ``return_lse`` not a bool, ``window_size`` not a pair of ints each -1 or >= 0,
        ``softcap`` not a finite real number >= 0, ``alibi_slopes`` not a float32 tensor of
        shape ``(num_heads,)`` / ``(batch_size, num_heads)`` with a contiguous last dimension
        on ``q``'s device (or requiring grad under grad mode), ``softcap / softmax_scale``
        outside ``[2**-100, 2**100]``, or ``dropout_p`` not a real number in ``[0, 1)``. The
        message
        names the argument. Also for a CUDA GPU of compute capability < 7.5. The rules are
        ``flash_attention_sm75._rules`` (one rulebook for every API); raised before any kernel
        launch.
    RuntimeError
        If the compiled extension is not available.
    NotImplementedError
        For forward-mode AD (an input carrying a ``torch.func.jvp`` /
        ``torch.autograd.forward_ad`` tangent: there is no jvp formula), and inside ``torch.func.grad`` / ``vjp`` / ``jacrev`` (the op's
        ``torch.library.register_autograd`` formula cannot serve them). Raised before the op
        runs.

    Notes
    -----
    Causal mask (1 = visible), bottom-right aligned, for ``seqlen_q = 2, seqlen_k = 5``::

        1 1 1 1 0
        1 1 1 1 1

    and for ``seqlen_q = 5, seqlen_k = 2``::

        0 0
        0 0
        0 0
        1 0
        1 1

    A query row that sees no key (the first three rows above) gets an output of 0 and a
    ``softmax_lse`` of ``-inf`` (never NaN). With ``seqlen_q == seqlen_k`` this is the usual
    lower-triangular mask, the same as ``torch.nn.functional.scaled_dot_product_attention``'s
    ``is_causal`` (which is top-left aligned and differs when ``seqlen_q != seqlen_k``).

    Grouped-query attention: if ``num_heads_k < num_heads``, query head ``i`` uses key/value head
    ``i // (num_heads // num_heads_k)``; e.g. with 6 query heads and 2 KV heads, query heads
    0, 1, 2 use KV head 0 and query heads 3, 4, 5 use KV head 1. ``num_heads_k == 1`` is
    multi-query attention. K/V are not copied.

    Algorithm: FlashAttention-2 (T. Dao, "FlashAttention-2: Faster Attention with Better
    Parallelism and Work Partitioning", 2023, arXiv:2307.08691), building on FlashAttention
    (T. Dao et al., 2022, arXiv:2205.14135), implemented for Turing (sm_75) tensor cores.

    Examples
    --------
    >>> q = torch.randn(2, 128, 8, 64, device="cuda", dtype=torch.float16)
    >>> k = torch.randn(2, 256, 2, 64, device="cuda", dtype=torch.float16)
    >>> v = torch.randn_like(k)
    >>> out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    >>> out.shape, lse.shape
    (torch.Size([2, 128, 8, 64]), torch.Size([2, 8, 128]))
    """
    _ops.require_extension()
    _rules.require_bool("causal", causal)
    _rules.require_bool("return_lse", return_lse)
    _rules.check_inputs(q, k, v, softmax_scale, layout="bshd", window_size=window_size,
                        softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p)
    out, softmax_lse = _ops.call_fwd(q, k, v, _as_float(softmax_scale), causal, True,
                                     None, None, *_window_args(window_size),
                                     _softcap_arg(softcap), alibi_slopes,
                                     dropout_p=float(dropout_p))
    if return_lse:
        return out, softmax_lse
    return out


def flash_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    return_lse: bool = False,
    *,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention with the FlashAttention-2 algorithm, BHSD layout.

    The same computation as :func:`flash_attn_func`, for tensors laid out like
    ``torch.nn.functional.scaled_dot_product_attention``'s ``(batch, heads, seq, head_dim)``.
    The inputs are passed to the kernel as ``x.transpose(1, 2)`` views: nothing is copied.

    Parameters
    ----------
    q : torch.Tensor
        Queries, shape ``(batch_size, num_heads, seqlen_q, head_dim)``, dtype ``torch.float16``.
        CUDA tensor (compute capability >= 7.5), or CPU tensor (reference
        implementation: forward in float64, backward in float32; it materializes the
        seqlen_q x seqlen_k scores: O(N^2) memory and far slower than torch's SDPA on CPU; it is
        meant for tests and portability). Any strides with ``stride(-1) == 1``; on CUDA the data pointer must be
        16-byte aligned and the batch, head and sequence strides divisible by 8 elements (where
        that dimension has more than one entry).
    k : torch.Tensor
        Keys, shape ``(batch_size, num_heads_k, seqlen_k, head_dim)``, same dtype, device and
        stride requirements as ``q``. ``num_heads`` must be divisible by ``num_heads_k`` (GQA,
        see Notes). ``head_dim`` must be a multiple of 8 from 8 to 256 (``_rules.HEAD_DIMS``).
    v : torch.Tensor
        Values, same shape as ``k``, same dtype, device and stride requirements as ``q``.
    causal : bool, optional
        Default ``False``. If ``True``, apply a causal mask aligned to the **bottom-right**
        corner (FlashAttention convention): query ``i`` sees key ``j`` iff
        ``j <= i + seqlen_k - seqlen_q``. Note this differs from torch SDPA's ``is_causal``
        (top-left) when ``seqlen_q != seqlen_k``; see Notes.
    softmax_scale : float, optional
        Multiplier of ``q @ k^T`` before the softmax: a real number (Python or numpy scalar) in
        ``[1.18e-38, 1.07e26]``, the range in which no float32 score can overflow for float16
        inputs. Default ``None`` means
        ``1 / sqrt(head_dim)``.
    return_lse : bool, optional
        Default ``False``. If ``True``, also return the softmax log-sum-exp.
    window_size : tuple of int, optional, keyword-only
        Sliding window ``(left, right)``, bottom-right aligned, as in :func:`flash_attn_func`.
        Default ``(-1, -1)``: none.
    softcap : float, optional, keyword-only
        Logit soft-capping as in :func:`flash_attn_func`: ``softcap > 0`` maps each scaled
        score ``s`` to ``softcap * tanh(s / softcap)``; finite and ``>= 0``; default ``0.0``:
        off.
    alibi_slopes : torch.Tensor, optional, keyword-only
        ALiBi slopes as in :func:`flash_attn_func`: ``float32`` ``(num_heads,)`` or
        ``(batch_size, num_heads)``, last dimension contiguous, on ``q``'s device; the score of
        query ``i`` and key ``j`` in head ``h`` gets ``-slope[h] * |i + seqlen_k - seqlen_q -
        j|``. Not differentiated (slopes requiring grad raise under grad mode). Default
        ``None``.
    dropout_p : float, optional, keyword-only
        Attention dropout as in :func:`flash_attn_func`: in ``[0, 1)``, default ``0.0``.

    Returns
    -------
    out : torch.Tensor
        Shape ``(batch_size, num_heads, seqlen_q, head_dim)``, ``torch.float16``, on the device
        of ``q``. It is a ``transpose(1, 2)`` view of a contiguous BSHD tensor (like the output
        of torch's memory-efficient SDPA), so ``out.transpose(1, 2)`` is contiguous. Returned
        alone when ``return_lse`` is ``False``.
    (out, softmax_lse) : tuple of torch.Tensor
        When ``return_lse`` is ``True``. ``softmax_lse`` has shape
        ``(batch_size, num_heads, seqlen_q)``, ``torch.float32``, contiguous: the natural log of
        ``sum_j exp(score_ij)`` over the keys row ``i`` sees (``score_ij``: the scaled score
        after ``softcap`` and ``alibi_slopes``).

        Zero sizes are valid (``batch_size``, ``seqlen_q``, ``seqlen_k`` or ``num_heads`` with
        ``num_heads_k`` of 0): the result has the shapes above, empty, or with
        ``seqlen_k == 0`` an ``out`` of zeros and a ``softmax_lse`` of ``-inf`` (query rows that
        see no key); the backward gives zero gradients. Nothing is launched.

    Raises
    ------
    ValueError
        If an input is invalid: sparse (not strided), not 4-D, not float16, on different
        devices, last
        dimension not contiguous, misaligned on CUDA, mismatched batch size or head_dim,
        ``k``/``v`` shapes differ, ``head_dim`` not a multiple of 8 in [8, 256], ``num_heads`` not divisible by
        ``num_heads_k`` (``num_heads_k == 0`` with ``num_heads >= 1`` included),
        ``softmax_scale`` not a real number in ``[1.18e-38, 1.07e26]``, or
        ``causal`` /
        ``return_lse`` not a bool, ``window_size`` not a pair of ints each -1 or >= 0,
        ``softcap`` not a finite real number >= 0, ``alibi_slopes`` not a float32 tensor of
        shape ``(num_heads,)`` / ``(batch_size, num_heads)`` with a contiguous last dimension
        on ``q``'s device (or requiring grad under grad mode), ``softcap / softmax_scale``
        outside ``[2**-100, 2**100]``, or ``dropout_p`` not a real number in ``[0, 1)``; also
        for a CUDA GPU of compute capability < 7.5. The message
        names the argument. The rules are ``flash_attention_sm75._rules`` (one rulebook for every
        API); raised before any kernel launch.
    RuntimeError
        If the compiled extension is not available.
    NotImplementedError
        For forward-mode AD (an input carrying a ``torch.func.jvp`` /
        ``torch.autograd.forward_ad`` tangent: there is no jvp formula), and inside ``torch.func.grad`` / ``vjp`` / ``jacrev`` (the op's
        ``torch.library.register_autograd`` formula cannot serve them). Raised before the op
        runs.

    Notes
    -----
    ``causal=True`` is **bottom-right** aligned (as in FlashAttention), not top-left as in
    ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``. Mask (1 = visible)
    for ``seqlen_q = 3, seqlen_k = 5``::

        bottom-right (this function)     top-left (torch SDPA is_causal)
        1 1 1 0 0                        1 0 0 0 0
        1 1 1 1 0                        1 1 0 0 0
        1 1 1 1 1                        1 1 1 0 0

    and for ``seqlen_q = 4, seqlen_k = 2`` (bottom-right)::

        0 0
        0 0
        1 0
        1 1

    A query row that sees no key gets an output of 0 and a ``softmax_lse`` of ``-inf``. The two
    alignments agree when ``seqlen_q == seqlen_k``. For top-left semantics use
    :func:`flash_attention_sm75.scaled_dot_product_attention`.

    Grouped-query attention: if ``num_heads_k < num_heads``, query head ``i`` uses key/value head
    ``i // (num_heads // num_heads_k)`` (the mapping of torch SDPA's ``enable_gqa=True``);
    ``num_heads_k == 1`` is multi-query attention. K/V are not copied.

    Algorithm: FlashAttention-2 (T. Dao, 2023, arXiv:2307.08691), building on FlashAttention
    (T. Dao et al., 2022, arXiv:2205.14135), implemented for Turing (sm_75) tensor cores.

    Examples
    --------
    >>> q = torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.float16)
    >>> k = torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.float16)
    >>> v = torch.randn_like(k)
    >>> flash_attention_forward(q, k, v, causal=True).shape
    torch.Size([2, 8, 128, 64])
    """
    _ops.require_extension()
    _rules.require_bool("causal", causal)
    _rules.require_bool("return_lse", return_lse)
    _rules.check_inputs(q, k, v, softmax_scale, layout="bhsd", window_size=window_size,
                        softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p)
    out, softmax_lse = _ops.call_fwd(q, k, v, _as_float(softmax_scale), causal, True, None, None,
                                     *_window_args(window_size), _softcap_arg(softcap),
                                     alibi_slopes, dropout_p=float(dropout_p), bhsd_inputs=True)
    out = out.transpose(1, 2)
    if return_lse:
        return out, softmax_lse
    return out
