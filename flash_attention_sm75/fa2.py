"""flash-attn 2.x's public functions on the SM75 kernels (the ``flash_attn`` drop-in's code).

Same names, positional order, defaults and return values as flash-attn 2.8.3's
``flash_attn.flash_attn_interface`` (``dropout_p`` is positional before ``softmax_scale``, as in
flash-attn 2; :func:`flash_attention_sm75.flash_attn_func` keeps flash-attn 3's order). The
optional ``flash_attn`` package in ``flash_attn_dropin/`` re-exports this module, so that
``import flash_attn`` and transformers' ``attn_implementation="flash_attention_2"`` run these.

Everything computed is exact attention (the op of docs/CONTRACT.md). What the kernels do not
have raises :class:`UnsupportedFeatureError` (both a ``NotImplementedError`` and a
``ValueError``) naming the argument and the value that is accepted, before any kernel launch:

* ``return_attn_probs=True`` with ``dropout_p > 0`` (flash-attn's ``S_dmask``);
* ``flash_attn_with_kvcache`` where a gradient could flow (flash-attn has no backward there and
  would silently give none).

``softcap`` (logit soft-capping, Gemma 2) and ``alibi_slopes`` (ALiBi) run on the kernels in
every function, with flash-attn's semantics (``softcap <= 0`` is off; NaN or infinite raises
``ValueError``); the varlen functions run on the varlen op (one call, every option included);
``flash_attn_with_kvcache`` is one kernel call with no host read, ALiBi and ``cache_leftpad``
included (see :func:`flash_attn_with_kvcache`).

Invalid input (dtype, shapes, devices, head dims above 256, ...) raises ``ValueError`` naming
the argument (the rulebook, ``_rules.py``). Differences from flash-attn, all documented in the
functions: rows that see no key give LSE ``-inf`` (flash-attn: ``+inf``); with ALiBi and causal
masking the LSE is that of flash-attn's documented scores, not of its causal kernels' shifted
ones (the ALiBi note in the functions' docstrings); ``S_dmask``
(``return_attn_probs=True``) is the empty tensor flash-attn itself returns when
``dropout_p == 0``; head dims that are not a multiple of 8 are zero-padded as flash-attn does;
tensors on the CPU run the op's reference (forward in float64, backward in float32).

``deterministic=True`` makes that call's backward deterministic (no floating-point atomics),
as in flash-attn, whatever ``FLASH_SM75_BWD_DQ`` and
:func:`~flash_attention_sm75.deterministic_backward` say when the backward runs; with ``False``
(the default) the package's rule (:func:`~flash_attention_sm75.is_deterministic_backward`)
applies when the backward runs.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from . import _ops, _packing, _rules

__all__ = [
    "UnsupportedFeatureError",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]

PREFIX = _rules.PREFIX


class UnsupportedFeatureError(NotImplementedError, ValueError):
    """A flash-attn feature the SM75 kernels do not implement (``S_dmask``, a gradient through
    ``flash_attn_with_kvcache``, ...). Both a ``NotImplementedError`` (the feature is missing
    here) and a ``ValueError`` (the value given cannot be served; what ``flash_attention_sm75``'s own APIs
    raise for the same options), so either ``except`` catches it."""


# ------------------------------------------------------------------------------------ options
def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{PREFIX}{name} must be a real number, got "
                         f"{_rules.type_name(value)} {value!r}")
    return float(value)


def _window(window_size: object) -> Tuple[int, int]:
    """flash-attn's ``window_size`` as two ints, any negative side as -1 (flash-attn's "no
    limit"); :func:`_flash_attn_window` then applies the rest of flash-attn's reading."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, numbers.Integral)
                   for w in window_size)):
        raise ValueError(f"{PREFIX}window_size must be a pair of ints (left, right), got "
                         f"{window_size!r}")
    return tuple(max(int(w), -1) for w in window_size)


def _flash_attn_window(left: int, right: int, causal: bool, seqlen_k: int) -> Tuple[int, int]:
    """flash-attn's reading of ``window_size`` for a call over ``seqlen_k`` keys (the cache's
    rows, or ``max_seqlen_k`` for packed sequences), as the op's pair: causal sets the right side
    to 0; a side at or past ``seqlen_k`` is no limit; then, where one side is limited and the
    other is not, the unlimited side becomes ``seqlen_k`` (flash-attn's ``set_params_fprop``).
    Only that right side can hide keys the op's -1 would show: bottom-right, row i then sees
    keys up to i + seqlen_k - seqlen_q + seqlen_k, fewer than all when seqlen_q > seqlen_k + 1.
    A left side of ``seqlen_k`` hides nothing, so it stays -1."""
    if causal:
        right = 0
    left = -1 if left >= seqlen_k else left
    right = -1 if right >= seqlen_k else right
    if left >= 0 and right < 0:
        right = seqlen_k
    return left, right


def _op_window(left: int, right: int, causal: bool, seqlen_k: int) -> Tuple[int, int]:
    """:func:`_flash_attn_window` as the dense and packed ops take it: under ``causal`` the op
    sets the right side itself, so it gets -1 there (a 0 would close the one-query GQA paths
    that take no window, ``group_rows_eligible``)."""
    left, right = _flash_attn_window(left, right, causal, seqlen_k)
    return left, -1 if causal else right


def _softcap(softcap: object) -> float:
    """flash-attn's ``softcap`` as the op's: a finite real number, where any value <= 0 is off
    (0.0), as flash-attn reads it; NaN and infinities raise (flash-attn would silently read NaN
    as off and +inf as a cap that overflows)."""
    cap = _real("softcap", softcap)
    if not -math.inf < cap < math.inf:  # not math.isfinite: torch.compile traces comparisons
        raise ValueError(f"{PREFIX}softcap must be a finite number (> 0: soft-capping, as "
                         f"softcap * tanh(score / softcap); 0 or below: off, as in flash-attn), "
                         f"got {softcap!r}")
    return cap if cap > 0.0 else 0.0


def _check_slopes(alibi_slopes, q: torch.Tensor, batch: int, num_heads: int) -> None:
    """The rulebook's ALiBi rule for a call of ``batch`` sequences and ``num_heads`` query
    heads (flash-attn's ``(nheads,)`` or ``(batch, nheads)`` float32)."""
    if alibi_slopes is not None:
        reason = _rules.alibi_slopes_problem(alibi_slopes, q.device, batch, num_heads)
        if reason is not None:
            raise ValueError(PREFIX + reason)


def _check_options(*, causal, dropout_p=0.0,
                   window_size=(-1, -1), softcap=0.0, deterministic=False,
                   bools: Sequence[Tuple[str, object]] = ()) -> Tuple[Tuple[int, int], float]:
    """Validate flash-attn's options (``ValueError`` naming the argument). Returns the window as
    the op's pair of ints (the kernels run sliding windows) and the softcap as the op's float
    (:func:`_softcap`); ``alibi_slopes`` are the rulebook's (:func:`_check_slopes`), and so is
    what ``dropout_p`` needs beyond its range (``_rules.dropout_problem``, asked through
    :func:`_require_valid`)."""
    _rules.require_bool("causal", causal)
    _rules.require_bool("deterministic", deterministic)  # served by the backward (_run)
    for name, value in bools:
        _rules.require_bool(name, value)
    dropout = _real("dropout_p", dropout_p)
    cap = _softcap(softcap)
    left, right = _window(window_size)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"{PREFIX}dropout_p must be in [0, 1), got {dropout_p!r}")
    return (left, right), cap


def _check_attn_probs(dropout_p, return_attn_probs) -> None:
    """flash-attn's ``S_dmask`` (``return_attn_probs=True`` with dropout, a testing aid) is not
    produced: :class:`UnsupportedFeatureError` naming both arguments."""
    if dropout_p and return_attn_probs:
        raise UnsupportedFeatureError(
            PREFIX + "not supported by the SM75 kernels: return_attn_probs=True with "
            f"dropout_p={dropout_p!r} (flash-attn's S_dmask, a testing aid; accepted: "
            "return_attn_probs=False, or dropout_p=0.0)")


# ------------------------------------------------------------------------------- the kernel call
def _pad_head_dim(q, k, v) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Zero-pad a shared head dim that is not a multiple of 8 (and below 256) up to the next one,
    as flash-attn does: the scores are unchanged and the extra output columns are dropped.
    Returns the tensors and the original head dim (anything else is left to the rulebook)."""
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in tensors):
        return q, k, v, -1
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d or d % 8 == 0 or not 0 < d < _rules.MAX_HEAD_DIM:
        return q, k, v, d
    pad = (0, 8 - d % 8)
    return F.pad(q, pad), F.pad(k, pad), F.pad(v, pad), d


def _require_valid_padded(q, k, v, softmax_scale, names) -> None:
    """:func:`_require_valid` on what the op will see: a head dim that :func:`_pad_head_dim`
    pads is checked on padded one-row stand-ins (the padded tensors are contiguous copies, so
    the rest of the rules see their layout; no copy of a whole cache just to check it)."""
    d = q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() == 4 else None
    if (d is not None and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (k, v))
            and k.shape[-1] == d and v.shape[-1] == d and d % 8 and 0 < d < _rules.MAX_HEAD_DIM):
        # one-row stand-ins (zeros of the same dtype and device for an empty tensor, e.g. no
        # new keys: its layout cannot matter)
        qp, kp, vp, _ = _pad_head_dim(*(
            t[:1, :1] if t.shape[0] and t.shape[1] else t.new_zeros((1, 1) + tuple(t.shape[2:]))
            for t in (q, k, v)))
        _require_valid(qp, kp, vp, _scale_for(softmax_scale, d, True), names)
    else:
        _require_valid(q, k, v, softmax_scale, names)


def _scale_for(softmax_scale, d_orig: int, padded: bool):
    """The scale to pass: flash-attn's default is 1/sqrt of the caller's head dim, which the op
    would compute from the padded one."""
    if softmax_scale is None:
        return d_orig ** -0.5 if padded else None
    return softmax_scale


def _require_valid(q, k, v, softmax_scale, names=("q", "k", "v"), alibi_slopes=None,
                   dropout_p=0.0) -> None:
    reason = _rules.not_supported_reason(q, k, v, softmax_scale, layout="bshd",
                                         check_alignment=False, names=tuple(names),
                                         alibi_slopes=alibi_slopes, dropout_p=dropout_p)
    if reason is not None:
        raise ValueError(PREFIX + reason)


def _last_dim_contiguous(*tensors):
    """flash-attn 2 (``maybe_contiguous``) copies a q / k / v whose last dimension is not
    contiguous instead of refusing it; so do its functions here (anything that is not a tensor is
    passed through, for the rulebook to name)."""
    return tuple(t.contiguous() if isinstance(t, torch.Tensor) and t.dim() >= 1
                 and t.stride(-1) != 1 else t for t in tensors)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    # flash-attn takes any strides with a contiguous last dim; the kernels' 16-byte loads need
    # aligned pointers and strides, so a CUDA tensor that has neither is copied. (4-D BSHD, or
    # 3-D packed varlen tokens.)
    if t.device.type == "cuda" and not _rules.is_kernel_aligned(
            t if t.dim() == 4 else t.unsqueeze(0)):
        return t.clone(memory_format=torch.contiguous_format)
    return t


def _run(q, k, v, softmax_scale, causal, leftpad_k=None, seqused_k=None, window=(-1, -1),
         softcap=0.0, alibi_slopes=None, deterministic=False, dropout_p=0.0):
    """The op on BSHD tensors (already validated), aligned for the kernels; ``deterministic``:
    flash-attn's flag, kept by autograd for this call's backward (``_ops.call_fwd``)."""
    scale = None if softmax_scale is None else float(softmax_scale)
    return _ops.call_fwd(_aligned(q), _aligned(k), _aligned(v), scale, causal, True,
                         leftpad_k, seqused_k, *window, softcap, alibi_slopes,
                         deterministic=deterministic, dropout_p=float(dropout_p))


def _attn_probs_placeholder(q: torch.Tensor) -> torch.Tensor:
    # flash-attn returns S_dmask only when dropout_p > 0; with dropout_p == 0 (the only value
    # served with return_attn_probs here) it returns this empty tensor.
    return q.new_empty((0,))


def _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
           deterministic, return_attn_probs, names=("q", "k", "v")):
    _ops.require_extension()
    for name, t in zip(names, (q, k, v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            _require_valid(q, k, v, softmax_scale, names)  # names the problem
    q, k, v = _last_dim_contiguous(q, k, v)
    window, cap = _check_options(causal=causal, dropout_p=dropout_p, window_size=window_size,
                                 softcap=softcap, deterministic=deterministic,
                                 bools=(("return_attn_probs", return_attn_probs),))
    _check_attn_probs(dropout_p, return_attn_probs)
    window = _op_window(*window, causal, k.shape[1])
    qp, kp, vp, d = _pad_head_dim(q, k, v)
    padded = qp is not q
    scale = _scale_for(softmax_scale, d, padded)
    _require_valid(qp, kp, vp, scale, names, alibi_slopes, float(dropout_p))
    out, lse = _run(qp, kp, vp, scale, causal, window=window, softcap=cap,
                    alibi_slopes=alibi_slopes, deterministic=deterministic, dropout_p=dropout_p)
    if padded:
        out = out[..., :d]
    if return_attn_probs:
        return out, lse, _attn_probs_placeholder(q)
    return out


# -------------------------------------------------------------------------------- dense APIs
_COMMON_DOC = """
    Exact attention on the SM75 kernels, with flash-attn 2's signature, defaults and return
    values. Grouped-query attention: ``num_heads`` must be a multiple of ``num_heads_k``; query
    head ``i`` uses key/value head ``i // (num_heads // num_heads_k)``. ``causal=True`` aligns
    the mask to the bottom-right corner: query ``i`` sees key ``j`` iff
    ``j <= i + seqlen_k - seqlen_q``; a row that sees no key gives output 0 and LSE ``-inf``
    (flash-attn writes ``+inf`` there). dtype float16 (bfloat16 raises ``ValueError``: Turing
    has no bf16 tensor cores); head_dim up to 256 (one that is not a multiple of 8 is zero-padded
    to the next, as flash-attn does); CUDA tensors, or CPU tensors on the op's reference (forward
    in float64, backward in float32). Any strides: a tensor whose last dimension is not
    contiguous is copied first (as flash-attn does), and so is a CUDA tensor the kernels'
    16-byte loads cannot read (a data pointer or a stride that is not a multiple of 8 elements).
    Gradients flow to the inputs. ``deterministic=True`` makes this call's backward
    deterministic (as flash-attn); with ``False`` it is deterministic too unless
    ``FLASH_SM75_BWD_DQ=atomic`` (read when the backward runs) selects fp32 atomics for dQ.

    ``window_size = (left, right)`` is flash-attn's sliding window (bottom-right aligned like
    ``causal``; a negative side is unbounded), run by the kernels' local instantiations.
    ``softcap > 0`` maps each scaled score ``s`` to ``softcap * tanh(s / softcap)`` (Gemma 2's
    logit soft-capping; ``softcap <= 0`` is off, as in flash-attn; NaN or infinite raises
    ``ValueError``). ``alibi_slopes``: see ALiBi below. ``dropout_p`` in [0, 1): attention
    dropout on the kernels (torch's semantics; the mask from torch's CUDA generator,
    regenerated by the backward at every head dim; under torch.compile the graph draws the
    seed). Options the kernels do not
    have raise :class:`UnsupportedFeatureError` (a ``NotImplementedError`` and a
    ``ValueError``) naming them: ``return_attn_probs=True`` with ``dropout_p > 0``. Invalid
    tensors raise ``ValueError`` naming the argument.

    Returns ``out``, or with ``return_attn_probs=True`` (``dropout_p == 0`` only) the tuple
    ``(out, softmax_lse, S_dmask)``: ``softmax_lse`` is float32, natural log; ``S_dmask`` is an
    empty tensor, which is what flash-attn returns when ``dropout_p == 0``.
"""

_ALIBI_DOC = """
    ALiBi: ``alibi_slopes`` float32 ``(nheads,)`` or ``(batch, nheads)`` (last dimension
    contiguous, on q's device), as in flash-attn: the score of query ``i`` and key ``j`` in head
    ``h`` gets ``-slope[h] * |i + seqlen_k - seqlen_q - j|`` (per sequence: its own lengths),
    after the soft-cap, with or without ``causal``. No gradient flows to the slopes (as in
    flash-attn); slopes that require grad raise ``ValueError`` while grad mode is on instead of
    being silently ignored (pass ``alibi_slopes.detach()``). The output and the gradients are
    flash-attn's; the LSE is that of the scores just defined. (flash-attn's causal kernels add
    ``slope * j`` instead, which gives the same output but shifts their LSE by
    ``slope * (i + seqlen_k - seqlen_q)``.)
"""


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """Attention over packed ``qkv`` of shape ``(batch, seqlen, 3, nheads, headdim)``.

    ``out``: ``(batch, seqlen, nheads, headdim)``; ``softmax_lse``: ``(batch, nheads, seqlen)``.
    The gradient of ``qkv`` comes back through the unbind (one copy per backward).
    """
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"{PREFIX}qkv must be a 5-D tensor (batch, seqlen, 3, nheads, headdim), "
                         f"got {_shape_of(qkv)}")
    q, k, v = qkv.unbind(2)
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  deterministic, return_attn_probs)


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """Attention of ``q`` ``(batch, seqlen_q, nheads, headdim)`` over packed ``kv`` of shape
    ``(batch, seqlen_k, 2, nheads_k, headdim)``.

    ``out``: ``(batch, seqlen_q, nheads, headdim)``; ``softmax_lse``: ``(batch, nheads,
    seqlen_q)``.
    """
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"{PREFIX}kv must be a 5-D tensor (batch, seqlen_k, 2, nheads_k, "
                         f"headdim), got {_shape_of(kv)}")
    k, v = kv.unbind(2)
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  deterministic, return_attn_probs)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """Attention of ``q`` ``(batch, seqlen_q, nheads, headdim)`` over ``k``, ``v``
    ``(batch, seqlen_k, nheads_k, headdim)``.

    ``out``: ``(batch, seqlen_q, nheads, headdim)``; ``softmax_lse``: ``(batch, nheads,
    seqlen_q)``. Positional order is flash-attn 2's (``dropout_p`` before ``softmax_scale``),
    unlike :func:`flash_attention_sm75.flash_attn_func` (flash-attn 3's order).
    """
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  deterministic, return_attn_probs)


for _f in (flash_attn_qkvpacked_func, flash_attn_kvpacked_func, flash_attn_func):
    _f.__doc__ += _COMMON_DOC + _ALIBI_DOC


def _shape_of(x) -> str:
    return (f"shape {list(x.shape)}" if isinstance(x, torch.Tensor)
            else f"{_rules.type_name(x)}")


# ------------------------------------------------------------------------------- varlen APIs
def _max_seqlen(name: str, value) -> int:
    """A host int from ``max_seqlen_*``: an int, or a 0-d integer tensor (read with one host
    synchronisation, as transformers passes for position_ids-packed sequences)."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{PREFIX}{name} must be an int >= 0 (the longest sequence), got "
                         f"{_rules.type_name(value)} {value!r}")
    return int(value)


def _cu_seqlens(name: str, cu: object, q: torch.Tensor) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{PREFIX}{name} must be a 1-D int32 tensor (batch + 1,), got "
                         f"{_shape_of(cu)}")
    if cu.dtype != torch.int32:
        raise ValueError(f"{PREFIX}{name} must be int32, got {cu.dtype}")
    if cu.device != q.device:
        raise ValueError(f"{PREFIX}{name} must be on the device of q ({q.device}), got "
                         f"{cu.device}")
    return cu


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs, block_table=None):
    _ops.require_extension()
    paged = block_table is not None
    for name, t, rank in (("q", q, 3), ("k", k, 4 if paged else 3), ("v", v, 4 if paged else 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != rank:
            layout = ("(num_blocks, page_block_size, nheads_k, headdim) with block_table"
                      if rank == 4 else "(total_tokens, nheads, headdim)")
            raise ValueError(f"{PREFIX}{name} must be a {rank}-D tensor {layout}, got "
                             f"{_shape_of(t)}")
    q, k, v = _last_dim_contiguous(q, k, v)
    cu_q = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, q)
    cu_k = _cu_seqlens("cu_seqlens_k", cu_seqlens_k, q)
    if cu_q.shape[0] != cu_k.shape[0]:
        raise ValueError(f"{PREFIX}cu_seqlens_q and cu_seqlens_k must have the same length "
                         f"(batch + 1), got {cu_q.shape[0]} and {cu_k.shape[0]}")
    max_q = _max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = _max_seqlen("max_seqlen_k", max_seqlen_k)
    window, cap = _check_options(causal=causal, dropout_p=dropout_p,
                                 window_size=window_size, softcap=softcap,
                                 deterministic=deterministic,
                                 bools=(("return_attn_probs", return_attn_probs),))
    _check_attn_probs(dropout_p, return_attn_probs)
    window = _op_window(*window, causal, max_k)
    batch = cu_q.shape[0] - 1
    _check_slopes(alibi_slopes, q, batch, q.shape[1])
    if paged:
        _check_block_table(block_table, batch, q)
        if k.shape[0] == 0:
            raise ValueError(f"{PREFIX}k must hold at least one block with block_table")
    _ops.require_varlen()
    if k.shape != v.shape:  # worded with the caller's shapes (the rulebook sees 4-D views)
        raise ValueError(f"{PREFIX}k and v must have the same shape, got k {list(k.shape)} and "
                         f"v {list(v.shape)}" + (_rules._VALUE_HEAD_DIM
                                                 if k.shape[-1] != v.shape[-1] else ""))
    qp, kp, vp, d = _pad_head_dim(q, k, v)
    padded = qp is not q
    scale = _scale_for(softmax_scale, d, padded)
    k4, v4 = (kp[:1], vp[:1]) if paged else (kp.unsqueeze(0), vp.unsqueeze(0))
    _require_valid(qp.unsqueeze(0), k4, v4, scale, dropout_p=float(dropout_p))
    # The op reads cu_seqlens as given: a sequence longer than max_seqlen_* must be caught
    # before it runs, on the device (no host synchronisation).
    _packing.check_cu_seqlens(cu_q, q.shape[0], max_q, "cu_seqlens_q")
    seqused = None
    if paged:
        kp, vp, cu_k, seqused = _gather_pages(kp, vp, cu_k, max_k, block_table)
    else:
        _packing.check_cu_seqlens(cu_k, k.shape[0], max_k, "cu_seqlens_k")
    out, lse = _ops.call_varlen_fwd(
        _aligned(qp), _aligned(kp), _aligned(vp), cu_q, cu_k, max_q, max_k,
        None if scale is None else float(scale), causal, seqused, *window, cap, alibi_slopes,
        deterministic=deterministic, dropout_p=float(dropout_p))
    if padded:
        out = out[..., :d]
    if not return_attn_probs:
        return out
    return out, lse, _attn_probs_placeholder(q)


def _gather_pages(k, v, cu_k, max_k: int, block_table):
    """Paged keys (``block_table``) as the varlen op's packed keys: sequence ``b``'s pages
    gathered into rows ``[b * max_k, (b + 1) * max_k)`` of a ``(batch * max_k, nheads_k,
    headdim)`` copy, of which ``seqused_k[b]`` (its length from ``cu_seqlens_k``) are attended.
    Returns ``(k, v, cu_seqlens_k, seqused_k)`` for the op. The lengths and the used pages'
    entries are checked on the device first."""
    batch = block_table.shape[0]
    page = k.shape[1]
    cu = cu_k.to(torch.int64)
    len_k = cu[1:] - cu[:-1]
    _packing.check_on_device(
        ((len_k >= 0) & (len_k <= max_k) & (len_k <= block_table.shape[1] * page)).all(),
        f"flash_attention_sm75: cu_seqlens_k must give lengths in [0, max_seqlen_k = "
        f"{_packing.shown(max_k)}] that fit the block_table's "
        f"{_packing.shown(block_table.shape[1])} pages of {_packing.shown(page)}")
    rows = (batch * max_k,) + tuple(k.shape[2:])
    if block_table.shape[1] == 0:  # no pages: every sequence is empty (checked above)
        kg, vg = k.new_zeros(rows), v.new_zeros(rows)
    else:
        _packing.check_block_table(block_table, len_k, page, k.shape[0])
        blk, off = _packing.paged_rows(block_table, page, torch.zeros_like(len_k), max_k,
                                       k.shape[0])
        kg, vg = k[blk, off].reshape(rows), v[blk, off].reshape(rows)
    cu_kg = torch.arange(batch + 1, dtype=torch.int32, device=cu_k.device) * max_k
    return kg, vg, cu_kg, len_k.to(torch.int32)


def _check_block_table(block_table, batch: int, q: torch.Tensor) -> None:
    if (not isinstance(block_table, torch.Tensor) or block_table.dim() != 2
            or block_table.shape[0] != batch):
        raise ValueError(f"{PREFIX}block_table must be a 2-D int32 tensor (batch, "
                         f"max_num_blocks_per_seq) with batch = {batch}, got "
                         f"{_shape_of(block_table)}")
    if block_table.dtype != torch.int32 or block_table.device != q.device:
        raise ValueError(f"{PREFIX}block_table must be int32 on the device of q ({q.device}), "
                         f"got {block_table.dtype} on {block_table.device}")


_VARLEN_DOC = """
    Variable-length sequences packed along the first dimension: sequence ``b`` holds the
    tokens ``cu_seqlens[b]:cu_seqlens[b + 1]`` (int32, ``(batch + 1,)``, on q's device; tokens
    outside every sequence, before ``cu_seqlens[0]`` or from ``cu_seqlens[-1]`` on, get output 0,
    LSE ``-inf`` and zero gradients). ``max_seqlen_*`` is the longest sequence, a host int (a 0-d
    integer tensor is read with one host synchronisation). Causal masking is bottom-right per
    sequence: query ``i`` of a sequence sees key ``j`` iff ``j <= i + len_k - len_q``; empty
    sequences are allowed, and a row that sees no key gives output 0 and LSE ``-inf``
    (flash-attn writes ``+inf``).

    How it runs: one call of the varlen op (``torch.ops.flash_attention_sm75.varlen_fwd``) on
    the packed tokens as they are (any strides; a last dimension that is not contiguous is
    copied, as flash-attn does, and so is a CUDA tensor that the kernels' 16-byte loads cannot
    read), with every option below; its
    backward (``varlen_bwd``) gives the gradients of q, k, v in the same layout. No host
    synchronisation, so ``torch.compile(fullgraph=True)`` and CUDA-graph capture work. A sequence
    longer than ``max_seqlen_*``, decreasing offsets or offsets outside the packed tensor are
    caught on the device before the op runs (``ValueError`` on the CPU, ``RuntimeError`` on the
    CPU in a torch.compile'd graph, a device-side assertion on CUDA) instead of giving a wrong
    result.

    ``dropout_p`` in [0, 1): attention dropout on the kernels, as in :func:`flash_attn_func`
    (torch's semantics; the backward regenerates the mask, at every head dim). The mask is drawn per call from an ``[seed,
    offset]`` pair that ``torch.randint`` takes from torch's generator (``varlen_fwd_dropout``):
    ``torch.manual_seed`` reproduces a run, each replay of a captured CUDA graph and each call
    of a compiled graph draws a new one; each sequence's mask depends on its index in the batch
    and its own query / key positions, not on where it sits in the packed tensor.

    Returns ``out`` ``(total_q, nheads, headdim)`` float16, or with ``return_attn_probs=True``
    ``(out, softmax_lse, S_dmask)`` with ``softmax_lse`` float32 ``(nheads, total_q)``
    (flash-attn's packed layout; differentiable) and ``S_dmask`` the empty tensor flash-attn
    returns when ``dropout_p == 0``. Gradients flow to q, k, v (and to the packed ``qkv`` /
    ``kv``). ``window_size`` applies per sequence (bottom-right aligned), and so do ``softcap``
    and ``alibi_slopes`` (``(nheads,)`` or ``(batch, nheads)``, ``batch`` the number of
    sequences: the distance of query ``i`` and key ``j`` of a sequence is
    ``|i + len_k - len_q - j|``). Invalid arguments (dtypes, shapes, devices, ``cu_seqlens``
    not int32 or of different lengths, ...) raise ``ValueError`` naming them; unsupported
    options raise :class:`UnsupportedFeatureError` as :func:`flash_attn_func` describes.
"""


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """Packed ``qkv`` ``(total, 3, nheads, headdim)`` with one ``cu_seqlens`` and ``max_seqlen``
    for queries and keys."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"{PREFIX}qkv must be a 4-D tensor (total, 3, nheads, headdim), got "
                         f"{_shape_of(qkv)}")
    q, k, v = qkv.unbind(1)
    return _varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """``q`` ``(total_q, nheads, headdim)`` over packed ``kv`` ``(total_k, 2, nheads_k,
    headdim)``."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(f"{PREFIX}kv must be a 4-D tensor (total_k, 2, nheads_k, headdim), "
                         f"got {_shape_of(kv)}")
    k, v = kv.unbind(1)
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """``q`` ``(total_q, nheads, headdim)`` over ``k``, ``v`` ``(total_k, nheads_k, headdim)``.

    ``block_table`` (int32 ``(batch, max_num_blocks_per_seq)``): paged keys, ``k`` and ``v``
    of shape ``(num_blocks, page_block_size, nheads_k, headdim)`` (any page size), sequence
    ``b``'s key ``j`` in block ``block_table[b, j // page_block_size]``; its length is
    ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` (at most ``max_seqlen_k``). The pages are gathered
    into a ``(batch * max_seqlen_k, nheads_k, headdim)`` copy for the varlen op (sequence ``b``
    in rows ``[b * max_seqlen_k, (b + 1) * max_seqlen_k)``, its length passed as the op's
    ``seqused_k``). The entries of pages that hold keys must be in ``[0, num_blocks)`` (checked
    on the device like ``cu_seqlens``); the others are not read for keys and may hold anything.
    """
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, block_table)


for _f in (flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func,
           flash_attn_varlen_func):
    _f.__doc__ += _VARLEN_DOC + _ALIBI_DOC


# ------------------------------------------------------------------------------------ KV cache
def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` channels of ``x`` ``(B, S, H, D)`` by the angles
    whose cos/sin are ``(B, S, rotary_dim / 2)``, in float32, rounded back to x's dtype (as
    flash-attn computes it): pairs ``(2i, 2i + 1)`` if ``interleaved``, else
    ``(i, i + rotary_dim / 2)`` (GPT-NeoX style)."""
    rd = 2 * cos.shape[-1]
    c, s = cos.float().unsqueeze(2), sin.float().unsqueeze(2)
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


def _int32_per_batch(name: str, t, batch: int, q: torch.Tensor) -> Optional[torch.Tensor]:
    if t is None:
        return None
    if (not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1
            or t.shape[0] != batch or t.device != q.device):
        raise ValueError(f"{PREFIX}{name} must be an int32 tensor of shape (batch,) = ({batch},) "
                         f"on the device of q ({q.device}), got "
                         + (f"{t.dtype} {list(t.shape)} on {t.device}"
                            if isinstance(t, torch.Tensor) else _rules.type_name(t)))
    return t


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[(int, torch.Tensor)]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """Attention of ``q`` over a KV cache, appending new keys/values to it first (flash-attn 2's
    ``flash_attn_with_kvcache``: same signature, defaults, semantics and in-place update).

    Parameters
    ----------
    q : (batch, seqlen_q, nheads, headdim) float16. Any strides (read from a copy when its last
        dimension is not contiguous or the kernels' 16-byte loads cannot read it, as ``k``, ``v``).
    k_cache, v_cache : (batch_cache, seqlen_cache, nheads_k, headdim), or with ``block_table``
        (num_blocks, page_block_size, nheads_k, headdim) (any page size); a contiguous last
        dimension (written in place, never copied; where the kernels also read them in place,
        on CUDA, a 16-byte aligned data pointer and strides that are multiples of 8 elements,
        as the op checks before any write). **Updated in place**
        when ``k`` / ``v`` are given. Without ``cache_batch_idx`` batch entry b uses cache row
        b (``batch_cache >= batch``, as flash-attn). Must not require grad under grad mode.
    k, v : (batch, seqlen_new, nheads_k, headdim), optional (both or neither; need
        ``cache_seqlens``). Written into the cache at rows ``cache_seqlens[b] + i`` (with
        device-side index ops, after every index is checked: see Raises), after the rotary
        embedding when ``rotary_cos`` is given.
    rotary_cos, rotary_sin : (seqlen_ro, rotary_dim / 2), q's dtype, ``seqlen_ro >=
        seqlen_cache``; only with ``k``. Applied (in float32) to the new keys at positions
        ``cache_seqlens[b] + i`` and to ``q`` at positions ``cache_seqlens[b] + i`` when causal
        (or windowed, as flash-attn decides), else all at ``cache_seqlens[b]``;
        ``rotary_interleaved`` pairs channels (0, 1), (2, 3), ... if True, else (i, i +
        rotary_dim / 2). Every position must be a row of the tables (causal: up to
        ``cache_seqlens[b] + seqlen_q - 1``).
    cache_seqlens : int or int32 (batch,), optional. Keys ``[cache_leftpad[b],
        cache_seqlens[b] + seqlen_new)`` are attended (None: the whole cache); each must be in
        ``[0, seqlen_cache - seqlen_new]`` (the new keys must fit in the cache).
        ``cache_leftpad`` is clamped into the cache like the op's key ranges.
    cache_batch_idx : int32 (batch,), optional. Cache row of batch entry b, in ``[0,
        k_cache.shape[0])`` (read in place, as a one-page-per-sequence table); no row twice when
        ``k`` / ``v`` are appended (two entries would write the same slots; flash-attn does not
        check it).
    cache_leftpad : int32 (batch,), optional. First valid cache row.
    block_table : int32 (batch, max_num_blocks_per_seq), optional. Paged cache, read in place by
        the kernels when ``page_block_size`` is a multiple of 64 (flash-attn 2 requires 256);
        other page sizes are gathered into a contiguous copy first. The entries of pages that hold keys
        (the first ``ceil((cache_seqlens[b] + seqlen_new) / page_block_size)`` of row b; all
        without ``cache_seqlens``) must be in ``[0, num_blocks)``; the others are not read for
        keys and may hold anything (e.g. -1). Not with ``cache_batch_idx`` or ``cache_leftpad``
        (as in flash-attn).
    softmax_scale, causal : as :func:`flash_attn_func`; causal is bottom-right per sequence
        (query ``i`` sees key row ``j`` iff ``j <= i + cache_seqlens[b] + seqlen_new -
        seqlen_q``), and has no effect when ``seqlen_q == 1``.
    window_size : (int, int). flash-attn's sliding window, per sequence, bottom-right aligned on
        its ``cache_seqlens[b] + seqlen_new`` keys; as in flash-attn, a side at or past
        ``seqlen_cache`` is no limit, each side on its own.
    softcap : float. flash-attn's logit soft-capping, ``softcap * tanh(score / softcap)``;
        ``<= 0`` is off (NaN or infinite raises ``ValueError``).
    alibi_slopes : float32 (nheads,) or (batch, nheads), optional. flash-attn's ALiBi, per
        sequence: query ``i`` and key row ``j`` get ``-slope * |i + L_b - seqlen_q - j'|``,
        ``L_b`` the sequence's attended keys (``cache_seqlens[b] + seqlen_new`` less
        ``cache_leftpad[b]``) and ``j'`` the key's position among them. The output is
        flash-attn's; the LSE is that of these scores (flash-attn's causal kernels shift it by
        ``slope * (i + L_b - seqlen_q)``). One kernel call, no host read.
    num_splits : int. flash-attn's split-KV count; a performance hint here (the kernels choose
        their own split), any int is accepted and has no effect on the result.
    return_softmax_lse : bool. Also return the float32 LSE ``(batch, nheads, seqlen_q)``.

    Returns
    -------
    out : (batch, seqlen_q, nheads, headdim), or ``(out, softmax_lse)``.

    Costs. One call of the KV-cache op (``torch.ops.flash_attention_sm75.kvcache_fwd``) appends
    the new keys / values and attends in place on the cache, plain, paged or selected by
    ``cache_batch_idx``, with the lengths on the device only (no host synchronisation, CUDA-graph
    capturable): calls without a window whose ``seqlen_q * nheads / nheads_k`` (query, head)
    rows per kv head fit the split-KV decode kernel (32 rows, 16 above head dim 128; ALiBi
    included) run there, everything else on the prefill kernels (with key splits where few
    CTAs stream a long cache), which align each sequence bottom-right themselves.
    The rotary embedding is a few small device ops before it. Two cases copy the cache first
    (after appending to it with index ops) and run the op on the copy: a page size that is not a
    multiple of 64 (the pages are gathered into a contiguous copy) and a head dim that is not a
    multiple of 8 (zero-padded, as flash-attn does).

    Raises
    ------
    UnsupportedFeatureError
        When a gradient could flow (grad mode on and q, k, v, k_cache or v_cache requiring
        grad): flash-attn has no backward here
        and would silently return none; call it under ``torch.no_grad()``.
    ValueError
        Invalid arguments, naming them (shapes, dtypes, devices; ``k`` without ``v`` or without
        ``cache_seqlens``; rotary without ``k``; ...), before anything is written. The values of
        ``cache_seqlens``, ``cache_batch_idx``, ``block_table`` and the rotary positions are
        checked too, before the cache is written: on the CPU a ``ValueError`` naming the
        argument; on CUDA, where reading them would cost a host synchronisation per call (and
        break CUDA-graph capture), a device-side assertion ordered before the writes (a CUDA
        error at the next synchronisation, which leaves the CUDA context unusable, as for
        invalid ``cu_seqlens``); under torch.compile on the CPU a ``RuntimeError`` at run time.
    """
    _ops.require_kvcache()
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{PREFIX}{name} must be a 4-D tensor, got {_shape_of(t)}")
    if (k is None) != (v is None):
        raise ValueError(f"{PREFIX}k and v must be given together (new keys and values)")
    # The caches are written in place: only q and the new k / v may be copied (flash-attn too
    # requires the caches' last dimension to be contiguous).
    q, k, v = _last_dim_contiguous(q, k, v)
    paged = block_table is not None
    batch, seqlen_q = q.shape[0], q.shape[1]
    if paged:
        _check_block_table(block_table, batch, q)
        if k_cache.shape[0] == 0:
            raise ValueError(f"{PREFIX}k_cache must hold at least one block with block_table")
        if cache_batch_idx is not None or cache_leftpad is not None:
            raise ValueError(f"{PREFIX}block_table cannot be combined with cache_batch_idx or "
                             f"cache_leftpad (as in flash-attn)")
        page = k_cache.shape[1]
        seqlen_cache = block_table.shape[1] * page
    else:
        seqlen_cache = k_cache.shape[1]
    (left, right), cap = _check_options(causal=causal, window_size=window_size,
                                        softcap=softcap,
                                        bools=(("rotary_interleaved", rotary_interleaved),
                                               ("return_softmax_lse", return_softmax_lse)))
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise ValueError(f"{PREFIX}num_splits must be an int, got {_rules.type_name(num_splits)}")
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in (q, k, v, k_cache, v_cache)):
        raise UnsupportedFeatureError(
            f"{PREFIX}flash_attn_with_kvcache has no backward (as in flash-attn, which returns "
            f"no gradient); call it under torch.no_grad() or torch.inference_mode(), or use "
            f"flash_attn_func for a differentiable call")
    if batch == 0 or k_cache.shape[0] == 0:
        raise ValueError(f"{PREFIX}q and k_cache must have a batch size >= 1 (as in "
                         f"flash-attn), got {batch} and {k_cache.shape[0]}")
    # q and the cache through the rulebook (metadata only; one batch entry of each, since the
    # cache's first dimension may be pages or selected rows), and v_cache's first dimension
    # against k_cache's: both are written at the same indices, before anything is written.
    _require_valid_padded(q[:1], k_cache[:1], v_cache[:1], softmax_scale,
                          ("q", "k_cache", "v_cache"))
    if isinstance(v_cache, torch.Tensor) and v_cache.shape != k_cache.shape:
        raise ValueError(f"{PREFIX}v_cache must have k_cache's shape {tuple(k_cache.shape)}, got "
                         f"{tuple(v_cache.shape)}")
    if not paged and k_cache.shape[0] != batch and cache_batch_idx is None:
        if k_cache.shape[0] < batch:
            raise ValueError(f"{PREFIX}k_cache must have at least batch = {batch} rows (q's) "
                             f"unless cache_batch_idx selects its rows, got {k_cache.shape[0]}")
        # flash-attn: without cache_batch_idx, batch entry b uses cache row b (a cache
        # allocated for a larger batch); views, so the appends land in the caller's cache.
        k_cache, v_cache = k_cache[:batch], v_cache[:batch]
    _check_slopes(alibi_slopes, q, batch, q.shape[2])
    if k is not None:
        if cache_seqlens is None:
            raise ValueError(f"{PREFIX}cache_seqlens must be given with k and v (where to append)")
        if (not isinstance(k, torch.Tensor) or k.dim() != 4 or k.shape[0] != batch
                or k.shape[2:] != k_cache.shape[2:]):
            raise ValueError(f"{PREFIX}k must be (batch, seqlen_new, nheads_k, headdim) = "
                             f"({batch}, *, {k_cache.shape[2]}, {k_cache.shape[3]}), got "
                             f"{_shape_of(k)}")
        _require_valid_padded(q, k, v, softmax_scale, ("q", "k", "v"))
    seqlen_new = 0 if k is None else k.shape[1]
    if seqlen_new > seqlen_cache:
        raise ValueError(f"{PREFIX}k has {seqlen_new} new keys, more than the cache holds "
                         f"(seqlen_cache = {seqlen_cache})")
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= seqlen_cache - seqlen_new:
            raise ValueError(f"{PREFIX}cache_seqlens must be in [0, seqlen_cache - seqlen_new] "
                             f"= [0, {seqlen_cache - seqlen_new}], got {cache_seqlens}")
        cache_seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32,
                                   device=q.device)
    cache_seqlens = _int32_per_batch("cache_seqlens", cache_seqlens, batch, q)
    cache_batch_idx = _int32_per_batch("cache_batch_idx", cache_batch_idx, batch, q)
    cache_leftpad = _int32_per_batch("cache_leftpad", cache_leftpad, batch, q)
    if rotary_cos is not None or rotary_sin is not None:
        _check_rotary(rotary_cos, rotary_sin, k, q, seqlen_cache)

    # flash-attn: causal has no effect on a single query row; it decides q's rotary positions
    # together with a window it still considers local (left < seqlen_cache, right likewise).
    is_causal = causal and seqlen_q != 1
    left, right = _flash_attn_window(left, right, is_causal, seqlen_cache)
    local = left >= 0 or right >= 0
    on_op = (q.shape[-1] % _rules.HEAD_DIM_MULTIPLE == 0
             and (not paged or page % _ops.PAGE_BLOCK_MULTIPLE == 0 or block_table.shape[1] == 1))
    # The KV-cache op checks cache_seqlens and the table itself, on the device and before its
    # writes (one launch); the door checks what only it sees (the rotary positions) and, on the
    # CPU and the other paths, the rest here.
    _check_cache_indices(cache_seqlens, cache_batch_idx, block_table, rotary_cos, k_cache,
                         seqlen_new, seqlen_cache, seqlen_q if (is_causal or local) else 1,
                         rotary_only=on_op and q.is_cuda)

    # Every index below is valid now: the writes into k_cache and v_cache cannot stop halfway.
    # q is only read: one the kernels' 16-byte loads cannot take is copied (as flash_attn_func
    # does) rather than refused by the op, which on the gathered-copy path below would come
    # after the appends. (The new k / v rows the op copies itself; the caches are written in
    # place, so a misaligned one is refused by the op before its writes.)
    q = _aligned(q)
    if not on_op and torch.compiler.is_compiling():
        # (while tracing q's data pointer is not read: a fresh copy is aligned whatever it is)
        q = q.clone(memory_format=torch.contiguous_format)
    with torch.no_grad():
        if rotary_cos is not None:
            base = cache_seqlens.to(torch.int64).view(-1, 1)
            pos = base + torch.arange(seqlen_new, device=q.device).view(1, -1)
            k = _rotary(k, rotary_cos[pos], rotary_sin[pos], rotary_interleaved)
            qpos = base + torch.arange(seqlen_q, device=q.device).view(1, -1) \
                if (is_causal or local) else base.expand(batch, seqlen_q)
            q = _rotary(q, rotary_cos[qpos], rotary_sin[qpos], rotary_interleaved)
        if on_op:
            # The KV-cache op: the appends and the attention in place on the cache (plain,
            # paged, or rows selected by cache_batch_idx as a one-page-per-sequence table), per
            # sequence bottom-right, lengths on the device only.
            table = (cache_batch_idx.reshape(batch, 1) if cache_batch_idx is not None
                     else block_table)
            if cache_seqlens is None:
                cache_seqlens = torch.full((batch,), seqlen_cache, dtype=torch.int32,
                                           device=q.device)
            out, lse = _ops.call_kvcache_fwd(
                q, k_cache, v_cache, cache_seqlens, k, v, cache_leftpad, table, softmax_scale,
                is_causal, left, right, cap, alibi_slopes)
            return (out, lse) if return_softmax_lse else out
        if k is not None:
            pos = cache_seqlens.to(torch.int64).view(-1, 1) + torch.arange(
                seqlen_new, device=q.device).view(1, -1)
            if paged:
                blk = block_table.to(torch.int64).gather(1, pos // page)
                k_cache[blk, pos % page] = k
                v_cache[blk, pos % page] = v
            else:
                rows = (torch.arange(batch, device=q.device) if cache_batch_idx is None
                        else cache_batch_idx.to(torch.int64)).view(-1, 1)
                k_cache[rows, pos] = k
                v_cache[rows, pos] = v
        # The copies the kernels cannot read in place (a page size that is not a multiple of
        # 64: gathered in order; a head dim that is not a multiple of 8: zero-padded), then the
        # KV-cache op on them without appends: one call, no host read.
        if paged or cache_batch_idx is not None:
            kc, vc = _gather_cache(k_cache, v_cache, block_table, cache_batch_idx,
                                   torch.zeros(batch, dtype=torch.int64, device=q.device),
                                   seqlen_cache, batch)
        else:
            kc, vc = k_cache, v_cache
        qp, kp, vp, d = _pad_head_dim(q, kc, vc)
        padded = qp is not q
        lens = (torch.full((batch,), seqlen_cache, dtype=torch.int32, device=q.device)
                if cache_seqlens is None else (cache_seqlens + seqlen_new).to(torch.int32))
        out, lse = _ops.call_kvcache_fwd(
            qp, kp, vp, lens, None, None, cache_leftpad, None,
            _scale_for(softmax_scale, d, padded), is_causal, left, right, cap, alibi_slopes)
    if padded:
        out = out[..., :d]
    return (out, lse) if return_softmax_lse else out


def _check_cache_indices(cache_seqlens, cache_batch_idx, block_table, rotary_cos, k_cache,
                         seqlen_new: int, seqlen_cache: int, q_positions: int,
                         rotary_only: bool = False) -> None:
    """The values of flash_attn_with_kvcache's index tensors, before anything is written:
    ``ValueError`` naming the argument on the CPU; on CUDA a device-side assertion
    (:func:`_packing.check_on_device`: the values live on the GPU, and reading them would cost a
    host synchronisation per call and break CUDA-graph capture), enqueued before the writes so
    that they do not run when it fails. ``q_positions``: how many rotary positions q takes from
    ``cache_seqlens[b]`` on. ``rotary_only``: only the rotary positions and cache_batch_idx's
    repeats (the KV-cache op checks the rest itself, on the device, before its writes)."""
    if cache_batch_idx is not None and seqlen_new > 0 and cache_batch_idx.numel() > 1:
        # two batch entries appending to one cache row would race on its slots
        s = torch.sort(cache_batch_idx).values
        _packing.check_on_device(
            (s[1:] != s[:-1]).all(),
            f"{PREFIX}cache_batch_idx must not repeat a cache row when k / v are appended "
            f"(two batch entries would write the same row), got a repeated value")
    if rotary_only:
        if rotary_cos is not None:
            _packing.check_on_device(
                (cache_seqlens.to(torch.int64) + q_positions <= rotary_cos.shape[0]).all(),
                f"{PREFIX}rotary_cos / rotary_sin must have a row for every position of q, "
                f"cache_seqlens[b] + i for i < {_packing.shown(q_positions)}; they have "
                f"{_packing.shown(rotary_cos.shape[0])} rows")
        return
    if cache_seqlens is not None:
        lens = cache_seqlens.to(torch.int64)
        _packing.check_on_device(
            ((lens >= 0) & (lens + seqlen_new <= seqlen_cache)).all(),
            f"{PREFIX}cache_seqlens must be in [0, seqlen_cache - seqlen_new] = [0, "
            f"{_packing.shown(seqlen_cache - seqlen_new)}] (seqlen_cache = "
            f"{_packing.shown(seqlen_cache)} rows, seqlen_new = {_packing.shown(seqlen_new)} new "
            f"keys written at rows cache_seqlens[b] + i), got a value outside")
        end = lens + seqlen_new
        if rotary_cos is not None:
            _packing.check_on_device(
                (lens + q_positions <= rotary_cos.shape[0]).all(),
                f"{PREFIX}rotary_cos / rotary_sin must have a row for every position of q, "
                f"cache_seqlens[b] + i for i < {_packing.shown(q_positions)}; they have "
                f"{_packing.shown(rotary_cos.shape[0])} rows")
    else:
        end = torch.full((k_cache.shape[0] if block_table is None else block_table.shape[0],),
                         seqlen_cache, dtype=torch.int64, device=k_cache.device)
    if cache_batch_idx is not None:
        _packing.check_on_device(
            ((cache_batch_idx >= 0) & (cache_batch_idx < k_cache.shape[0])).all(),
            f"{PREFIX}cache_batch_idx must hold cache rows in [0, k_cache.shape[0] = "
            f"{_packing.shown(k_cache.shape[0])}), got a value outside")
    if block_table is not None:
        _packing.check_block_table(block_table, end, k_cache.shape[1], k_cache.shape[0])


def _check_rotary(cos, sin, k, q, seqlen_cache: int) -> None:
    if k is None:
        raise ValueError(f"{PREFIX}rotary_cos / rotary_sin need k and v (the new keys they "
                         f"rotate), as in flash-attn")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{PREFIX}{name} must be a 2-D tensor (seqlen_ro, rotary_dim / 2), "
                             f"got {_shape_of(t)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{PREFIX}{name} must have q's dtype and device ({q.dtype}, "
                             f"{q.device}), got {t.dtype} on {t.device}")
    if cos.shape != sin.shape:
        raise ValueError(f"{PREFIX}rotary_cos and rotary_sin must have one shape, got "
                         f"{list(cos.shape)} and {list(sin.shape)}")
    rd = 2 * cos.shape[1]
    if not 0 < rd <= q.shape[-1]:
        raise ValueError(f"{PREFIX}rotary_dim = 2 * rotary_cos.shape[1] = {rd} must be in "
                         f"[2, headdim = {q.shape[-1]}]")
    if cos.shape[0] < seqlen_cache:
        raise ValueError(f"{PREFIX}rotary_cos must have at least seqlen_cache = {seqlen_cache} "
                         f"rows, got {cos.shape[0]}")


def _gather_cache(k_cache, v_cache, block_table, cache_batch_idx, shift, seqlen_cache: int,
                  batch: int):
    """A (batch, seqlen_cache, nheads_k, headdim) copy of each batch entry's cache row, shifted
    right by ``shift[b]`` rows (row r holds cache row r - shift[b]; the rows before the shift
    repeat row 0 and lie outside the key range)."""
    if block_table is not None:
        blk, off = _packing.paged_rows(block_table, k_cache.shape[1], shift, seqlen_cache,
                                       k_cache.shape[0])
        return k_cache[blk, off], v_cache[blk, off]
    rows = (torch.arange(seqlen_cache, device=k_cache.device).view(1, -1)
            - shift.view(-1, 1)).clamp(min=0)
    b = (torch.arange(batch, device=k_cache.device) if cache_batch_idx is None
         else cache_batch_idx.to(torch.int64)).view(-1, 1)
    return k_cache[b, rows], v_cache[b, rows]
