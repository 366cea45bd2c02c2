"""The rulebook: what the kernels accept, written once.

Every door asks :func:`not_supported_reason` and adds only its own extras:

* the direct APIs (``flash_attn_func``, ``flash_attention_forward``) raise ``ValueError`` with
  its reason (:func:`check_inputs`);
* the SDPA wrapper (``sdpa.py``) and the Hugging Face integration (``integrations/
  transformers.py``) fall back to torch with it;
* the C++ ``check_fwd_inputs`` / ``mha_fwd`` (csrc/flash_api.cpp) enforce the same rules at run
  time with the same messages (up to the printed value: C++ prints c10 names) (``tests/test_rules.py`` proves it rule by rule from
  :data:`RULES`).

The declarative part (dtypes, head dims, alignment, limits) is the module's constants; the
function reads them and never spells a value itself. A new feature (a head dim, a mask kind) is
added here, in the C++ check and as a row of ``tests/test_rules.py``.

The reason strings carry no ``"flash_attention_sm75: "`` prefix; the C++ messages are the same
strings after that prefix.
"""
from __future__ import annotations

import functools
import math
import numbers
from typing import Optional, Sequence, Tuple

import torch

__all__ = [
    "DTYPES",
    "HEAD_DIMS",
    "KEY_RANGE_DTYPE",
    "MIN_COMPUTE_CAPABILITY",
    "RULES",
    "SOFTMAX_SCALE_MAX",
    "SOFTMAX_SCALE_MIN",
    "SOFTCAP_RATIO_MAX",
    "SOFTCAP_RATIO_MIN",
    "alibi_slopes_problem",
    "attn_bias_problem",
    "BIAS_DTYPES",
    "BIAS_SCALE_MIN",
    "gradient_flows",
    "check_inputs",
    "NO_WINDOW",
    "softcap_problem",
    "softcap_scale_problem",
    "window_size_problem",
    "is_kernel_aligned",
    "not_supported_reason",
    "require_bool",
    "scale_problem",
    "type_name",
]

PREFIX = "flash_attention_sm75: "

# ---------------------------------------------------------------------------------- the rules
DTYPES: Tuple[torch.dtype, ...] = (torch.float16,)
"""Element types of q, k and v (SM75 tensor cores have no bf16 or fp32 MMA)."""

HEAD_DIM_MULTIPLE = 8
"""head_dim must be a multiple of this (one 16-byte vector of fp16)."""

HEAD_DIM_BUCKETS: Tuple[int, ...] = (64, 96, 128, 256)
"""The compiled head dims (csrc/kernels/head_dims.h): head_dim d runs on the smallest bucket
>= d, with the columns past d zero-filled on load and never stored."""

MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]

HEAD_DIMS: Tuple[int, ...] = tuple(range(HEAD_DIM_MULTIPLE, MAX_HEAD_DIM + 1, HEAD_DIM_MULTIPLE))
"""Every head_dim the kernels take (q, k and v share one): the multiples of 8 up to the
largest bucket."""

_VALUE_HEAD_DIM = " (a value head_dim different from the query/key head_dim is not supported)"

_HEAD_DIM_RULE = f"a multiple of {HEAD_DIM_MULTIPLE} from {HEAD_DIM_MULTIPLE} to {MAX_HEAD_DIM}"


def is_head_dim(d: int) -> bool:
    """``d in HEAD_DIMS``, as arithmetic (the rulebook's hot path)."""
    return HEAD_DIM_MULTIPLE <= d <= MAX_HEAD_DIM and d % HEAD_DIM_MULTIPLE == 0


def head_dim_bucket(d: int) -> int:
    """The compiled head dim that runs ``d`` (0 when none does)."""
    if is_head_dim(d):
        return next(b for b in HEAD_DIM_BUCKETS if d <= b)
    return 0

MIN_COMPUTE_CAPABILITY: Tuple[int, int] = (7, 5)
"""The oldest GPU the kernels run on (Turing); newer ones run the same SM75 instructions."""

VECTOR_BYTES = 16
"""The kernels move 16-byte vectors: data pointers aligned to it, and batch, sequence and head
strides a multiple of its element count (8 fp16) wherever that dimension has more than one entry."""

STRIDE_MULTIPLE = VECTOR_BYTES // 2

MAX_EXTENT = 2**31 - 1
"""batch, seqlen and heads are int32 in the kernels' index arithmetic."""

KEY_RANGE_DTYPE = torch.int32
"""leftpad_k / seqused_k: int32 (batch,) tensors on q's device, contiguous."""

# softmax_scale must survive the kernel's float32 arithmetic for every float16 input: normal in
# float32 (a denormal scale is flushed to 0 by --use_fast_math), and small enough that the
# largest possible score, scale * log2(e) * q.k with |q.k| <= 256 * 65504^2 (head_dim 256, fp16
# max), stays finite with a factor 2 of headroom: at exactly FLT_MAX / (log2(e) * 256 * 65504^2)
# the float32 roundings of scale * log2(e) and of the product give inf, and an inf score gives
# inf - inf = NaN in the softmax.
SOFTMAX_SCALE_MIN = 1.1754943508222875e-38  # FLT_MIN
SOFTMAX_SCALE_MAX = 3.4028234663852886e38 / (2 * 1.4426950408889634 * 256 * 65504.0**2)  # ~1.07e26
SOFTCAP_RATIO_MIN = 2.0 ** -100  # softcap / softmax_scale (softcap_scale_problem)
SOFTCAP_RATIO_MAX = 2.0 ** 100
_SCALE_RANGE = "[1.18e-38, 1.07e26]"

RULES: Tuple[str, ...] = (
    "tensor",          # q, k, v are dense strided torch.Tensors (not nested, not sparse)
    "device",          # CUDA (the CPU reference op where the door allows it)
    "rank",            # 4-D
    "dtype",           # DTYPES
    "same_device",     # k, v (and key ranges) on q's device
    "last_dim",        # stride(-1) == 1
    "kv_shape",        # k.shape == v.shape
    "batch",           # equal batch sizes
    "head_dim_match",  # q and k share head_dim
    "head_dim",        # HEAD_DIMS
    "kv_heads",        # num_heads_k >= 1 when num_heads >= 1
    "gqa",             # num_heads % num_heads_k == 0
    "extent",          # MAX_EXTENT
    "key_range",       # leftpad_k / seqused_k: KEY_RANGE_DTYPE, (batch,), device, contiguous
    "softmax_scale",   # finite, [SOFTMAX_SCALE_MIN, SOFTMAX_SCALE_MAX]
    "window_size",     # (left, right) ints, each -1 (no limit) or >= 0
    "softcap",         # a real number, finite, >= 0 (0: off); > 0: softcap / softmax_scale
                       # in [SOFTCAP_RATIO_MIN, SOFTCAP_RATIO_MAX]
    "alibi_slopes",    # None or float32 (num_heads,) / (batch, num_heads), last dim contiguous,
                       # q's device, no key ranges, not requiring grad (under grad mode)
    "attn_bias",       # None or BIAS_DTYPES, broadcasts to (batch, num_heads, seqlen_q,
                       # seqlen_k), q's device, slice < 2^31 elements; floating: softmax_scale
                       # >= BIAS_SCALE_MIN; with a backward (or
                       # the bias requiring grad): no softcap, head_dim <=
                       # BIAS_BACKWARD_MAX_HEAD_DIM
    "dropout_p",       # a real number in [0, 1) (traced: the seeded op, a full memory budget)
    "alignment",       # VECTOR_BYTES data pointer, strides of STRIDE_MULTIPLE
    "capability",      # MIN_COMPUTE_CAPABILITY
)
"""Every rule, in the order they are checked: the C++ order, except that the device type comes
first (the C++ op is dispatched by device; the doors that fall back for non-CUDA tensors should
say so first). tests/test_rules.py has one row per rule that breaks exactly it and compares our
reason with the C++ op's error."""


# ---------------------------------------------------------------------------------- helpers
def type_name(obj: object) -> str:
    """``obj``'s type for error messages: qualified outside builtins, so that e.g. numpy's
    ``np.bool_`` (whose ``__name__`` is ``bool``) reads ``numpy.bool`` and not ``bool``."""
    t = type(obj)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def require_bool(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is a bool (``causal=0.125``, a scale passed in the
    wrong slot, must not silently mean True); ``name`` is the argument as the caller wrote it."""
    if not isinstance(value, bool):
        raise ValueError(f"{PREFIX}{name} must be a bool (True or False), "
                         f"got {type_name(value)} {value!r}")


def scale_problem(softmax_scale: object, name: str = "softmax_scale") -> Optional[str]:
    """None if ``softmax_scale`` (not None) is a usable scale, else what is wrong with it (the
    argument called ``name``: ``scale`` in torch's SDPA, ``scaling`` in transformers)."""
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        return (f"{name} must be a real number (float or int), got "
                f"{type_name(softmax_scale)} {softmax_scale!r}")
    s = float(softmax_scale)
    if not (math.isfinite(s) and SOFTMAX_SCALE_MIN <= s <= SOFTMAX_SCALE_MAX):
        return (f"{name} must be a finite number > 0 within {_SCALE_RANGE} (float32 "
                f"scores must not overflow), got {softmax_scale!r}")
    return None


def softcap_scale_problem(softcap: float, softmax_scale: Optional[float], head_dim: int,
                          scale_name: str = "softmax_scale") -> Optional[str]:
    """None if a usable ``softcap`` (:func:`softcap_problem`) can run with this scale (None:
    ``1 / sqrt(head_dim)``), else why not. The kernels cap raw scores as
    ``tanh(s * scale / softcap) * (softcap / scale)`` in float32: softcap / scale must lie in
    [SOFTCAP_RATIO_MIN, SOFTCAP_RATIO_MAX] = [2^-100, 2^100], which keeps both factors normal
    floats and makes flushing a tiny ``s * scale / softcap`` to 0 change a score by under
    2^-26 * scale. Outside it a factor overflowed to inf (NaN scores) or to 0. The C++ op checks
    the same (``check_score_mod``)."""
    if not softcap:
        return None
    # 1 / sqrt(d), as the C++ op computes it (head_dim ** -0.5 differs by an ulp for some d)
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    if not SOFTCAP_RATIO_MIN <= softcap / scale <= SOFTCAP_RATIO_MAX:
        return (f"softcap / {scale_name} must be within [2^-100, 2^100] (float32 factors of "
                f"the soft-cap), got softcap {float(softcap)!r} and {scale_name} {scale!r}")
    return None


NO_WINDOW: Tuple[int, int] = (-1, -1)
"""flash-attn's ``window_size`` default: no sliding window."""


def window_size_problem(window_size: object) -> Optional[str]:
    """None if ``window_size`` is a usable sliding window ``(left, right)``: a pair of ints, each
    -1 (no limit on that side) or >= 0 (key ``j`` is visible to query ``i`` iff
    ``i + off - left <= j <= i + off + right``, ``off`` the causal alignment's offset), else what
    is wrong with it. The C++ op checks the same (``check_window_size``)."""
    # The identity fast path only outside torch.compile: dynamo cannot trace ``is`` between a
    # constant tuple and one holding a SymInt (an int argument made dynamic on recompilation)
    # or a numpy integer, which broke fullgraph=True.
    if not torch.compiler.is_compiling() and window_size is NO_WINDOW:
        return None
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2):
        return (f"window_size must be a pair (left, right) of ints, each -1 (no limit) or >= 0, "
                f"got {type_name(window_size)} {window_size!r}")
    for side, w in zip(("left", "right"), window_size):
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            return (f"window_size_{side} must be an int, -1 (no limit) or >= 0, got "
                    f"{type_name(w)} {w!r}")
        if w < -1:
            return f"window_size_{side} must be -1 (no limit) or >= 0, got {int(w)}"
    return None


def softcap_problem(softcap: object) -> Optional[str]:
    """None if ``softcap`` is a usable logit soft-cap: a real number (Python or numpy scalar),
    finite and >= 0, where 0 is off and ``c > 0`` maps each scaled score ``s`` to
    ``c * tanh(s / c)`` (flash-attn's / Gemma 2's), else what is wrong with it. The C++ op checks
    the same (``check_score_mod``). flash-attn's own door also takes negative values as "off";
    ``fa2.py`` maps them to 0 before asking."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        return (f"softcap must be a real number (float or int), finite and >= 0 (0: no "
                f"soft-capping), got {type_name(softcap)} {softcap!r}")
    if not 0 <= softcap < math.inf:  # NaN fails too; comparisons trace under torch.compile
        return f"softcap must be a finite number >= 0 (0: no soft-capping), got {softcap!r}"
    return None


_SLOPES_GRAD = ("alibi_slopes must not require grad: the kernels compute no gradient for the "
                "slopes (pass alibi_slopes.detach() to treat them as constants)")


def alibi_slopes_problem(alibi_slopes: object, device: torch.device, batch: int,
                         num_heads: int, key_ranges: bool = False) -> Optional[str]:
    """None if ``alibi_slopes`` (not None) are usable ALiBi slopes for a call on ``device`` with
    ``batch`` entries and ``num_heads`` query heads, else what is wrong with them: a float32
    tensor of shape ``(num_heads,)`` or ``(batch, num_heads)``, last dimension contiguous, on
    ``device``, in a call without key ranges (``key_ranges``: leftpad_k / seqused_k given), and
    not requiring grad while grad mode is on (no slope gradient). Query ``i`` and key ``j`` then
    get ``- slope * |i + off - j|`` added to their (soft-capped) score, ``off`` the causal
    alignment's offset, also without causal. The C++ op checks the same (``check_score_mod``),
    except the gradient rule (``_ops.call_fwd`` states it)."""
    a = alibi_slopes
    if not isinstance(a, torch.Tensor):
        return f"alibi_slopes must be a torch.Tensor or None, got {type_name(a)}"
    if a.layout != torch.strided:
        return f"alibi_slopes must be a strided (dense) tensor, got {a.layout}"
    if a.dtype != torch.float32:
        return f"alibi_slopes must be float32, got {a.dtype}"
    if a.device != device:
        return f"alibi_slopes must be on q's device ({device}), got {a.device}"
    if not ((a.dim() == 1 and a.shape[0] == num_heads)
            or (a.dim() == 2 and a.shape[0] == batch and a.shape[1] == num_heads)):
        return (f"alibi_slopes must have shape (num_heads,) = ({num_heads},) or (batch, "
                f"num_heads) = ({batch}, {num_heads}), got {list(a.shape)}")
    if a.numel() != 0 and a.stride(-1) != 1:
        return (f"alibi_slopes must be contiguous in its last dimension, got strides "
                f"{list(a.stride())}")
    if key_ranges:
        return ("alibi_slopes cannot be combined with leftpad_k / seqused_k (the ALiBi distance "
                "of a key range is not defined here); pass alibi_slopes=None or no key ranges")
    if a.requires_grad and torch.is_grad_enabled():
        return _SLOPES_GRAD
    return None


BIAS_DTYPES: Tuple[torch.dtype, ...] = (torch.bool, torch.float16, torch.bfloat16, torch.float32)
"""attn_bias element types: a boolean mask (True = attend) or an additive bias, added in fp32."""

BIAS_BACKWARD_MAX_HEAD_DIM = 128
"""The backward reads a bias up to this head dim bucket (``kBwdBiasMaxHeadDim``, csrc/kernels/
flash.h: the d = 256 dK/dV kernel has no registers left for it)."""

BIAS_SCALE_MIN = 2.0 ** -27
"""The smallest softmax_scale a floating (non-bool) attn_bias runs with (``kBiasScaleMin``,
csrc/flash_api.h): the kernels add a bias in raw units (bias / softmax_scale) and clamp raw
values beyond ~1.7e38, so that a dtype-minimum mask stays finite; from this scale on only
|bias| > ~1.3e30 (mask sentinels) reaches the clamp. Below it finite biases that are no mask
would be clamped: refused rather than approximated."""

MAX_DBIAS_SLICE = 2 ** 31 - 1
"""The largest seqlen_q * seqlen_k with a bias gradient (``kMaxDbiasSlice``: the dQ kernel writes
a (batch, head) slice of it with 32-bit offsets)."""


def gradient_flows(*tensors) -> bool:
    """Grad mode is on and one of ``tensors`` (None entries skipped) requires grad: a backward
    will follow (the bias rule's backward limits apply)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def backward_may_follow(*tensors, dropout_p: object = 0.0) -> bool:
    """The backward's limits apply to a call: a gradient flows (:func:`gradient_flows`), or the
    call has dropout. A dropout call's decision must not depend on grad mode: a reentrant
    checkpoint runs the forward without grad and recomputes it with grad, and both runs must
    take the same path, since the kernels' mask and torch's come from different generators (a
    no-grad kernel run and a recomputed fallback would pair one mask's output with another's
    gradients)."""
    dropout = (isinstance(dropout_p, numbers.Real) and not isinstance(dropout_p, bool)
               and dropout_p != 0)
    return dropout or gradient_flows(*tensors)


def attn_bias_problem(attn_bias: object, q: torch.Tensor, seqlen_k: int, *,
                      layout: str = "bshd", backward: bool = False, softcap: float = 0.0,
                      name: str = "attn_bias",
                      bias_grad: Optional[bool] = None,
                      softmax_scale: Optional[float] = None,
                      scale_name: str = "softmax_scale") -> Optional[str]:
    """None if ``attn_bias`` (not None) is a bias the kernels read, else what is wrong with it:
    a dense tensor of :data:`BIAS_DTYPES` (bool: True = attend; float16 / bfloat16 / float32:
    added to the scaled scores in fp32), on q's device, of a shape that broadcasts to
    ``(batch, num_heads, seqlen_q, seqlen_k)`` as torch broadcasts (1-D to 4-D, trailing
    dimensions aligned, each of that size or 1), whose ``(seqlen_q, seqlen_k)`` slice spans
    at most 2^31 elements through its strides. ``backward`` (a gradient will flow to q, k or v),
    or the bias itself requiring grad while grad mode is on (the backward computes its gradient,
    dS summed over the broadcast dimensions): also no softcap with it and head_dim at most
    :data:`BIAS_BACKWARD_MAX_HEAD_DIM`; and for the bias's own gradient seqlen_q * seqlen_k at
    most :data:`MAX_DBIAS_SLICE`. ``bias_grad``: whether the bias's gradient is wanted (None:
    it requires grad while grad mode is on; a backward formula, which runs without grad mode,
    says it). ``name``: the argument as the door calls it (``attn_mask`` in
    the SDPA wrapper). A floating bias needs ``softmax_scale`` (None: the default 1 / sqrt(head_dim),
    always fine; the door calls it ``scale_name``) of at least :data:`BIAS_SCALE_MIN`. The C++ op
    checks the same (``check_attn_bias``, ``check_bias_backward``,
    ``make_dbias``)."""
    b = attn_bias
    if not isinstance(b, torch.Tensor):
        return f"{name} must be a torch.Tensor or None, got {type_name(b)}"
    if b.is_nested or b.layout != torch.strided:
        return f"{name} must be a strided (dense) tensor, got {b.layout}"
    if b.dtype not in BIAS_DTYPES:
        return (f"{name} must be bool (True = attend), float16, bfloat16 or float32, got "
                f"{b.dtype}")
    if b.device != q.device:
        return f"{name} must be on q's device ({q.device}), got {b.device}"
    if b.dtype != torch.bool and softmax_scale is not None and softmax_scale < BIAS_SCALE_MIN:
        return (f"a {b.dtype} {name} needs {scale_name} >= 2^-27 (7.45e-09; below it the kernels "
                f"would clamp finite bias values), got {softmax_scale!r}")
    qs = q.shape
    hd = 1 if layout == "bhsd" else 2
    target = (qs[0], qs[hd], qs[3 - hd], seqlen_k)
    ok = 1 <= b.dim() <= 4
    for i in range(min(b.dim(), 4)):
        size = b.shape[b.dim() - 1 - i]
        ok = ok and (size == target[3 - i] or size == 1)
    if not ok:
        return (f"{name} of shape {list(b.shape)} does not broadcast to (batch, num_heads, "
                f"seqlen_q, seqlen_k) = {target} (1-D to 4-D, trailing dimensions aligned, "
                f"each of that size or 1)")
    st = b.stride()
    rs = st[-2] if b.dim() >= 2 and b.shape[-2] != 1 else 0
    cs = st[-1] if b.shape[-1] != 1 else 0
    extent = (target[2] - 1) * rs + (target[3] - 1) * cs
    if extent > MAX_EXTENT or rs < 0 or cs < 0:
        return (f"{name}'s (batch, head) slice spans {extent + 1} elements through its strides; "
                f"the kernels address fewer than 2^31")
    if bias_grad is None:
        bias_grad = b.requires_grad and torch.is_grad_enabled()
    if bias_grad:
        if target[2] * target[3] > MAX_DBIAS_SLICE:
            return (f"{name} requires grad and seqlen_q * seqlen_k = {target[2] * target[3]} "
                    f"exceeds {MAX_DBIAS_SLICE} (the bias gradient's per-head slice)")
        backward = True
    if backward:
        if softcap:
            return (f"{name} with softcap has no backward here (softcap = {softcap}); pass "
                    f"softcap=0 or no {name}")
        if head_dim_bucket(qs[3]) > BIAS_BACKWARD_MAX_HEAD_DIM:
            return (f"{name} has no backward at head_dim {qs[3]} (the backward reads a bias up "
                    f"to head_dim {BIAS_BACKWARD_MAX_HEAD_DIM})")
    return None


def dropout_problem(dropout_p: object) -> Optional[str]:
    """None if ``dropout_p`` is a dropout probability the kernels apply, forward and backward,
    padded or packed, at every head dim (a real number, not a bool, in [0, 1); while a graph is
    traced (``_ops.graph_tracing``), only with an extension that has ``fwd_dropout_seeded`` and
    a ``torch._functorch.config.activation_memory_budget`` of 1), else what is wrong. The C++
    ops check the range (``check_dropout_p``)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        return f"dropout_p must be a real number in [0, 1), got {type_name(dropout_p)}"
    if not 0.0 <= dropout_p < 1.0:
        return f"dropout_p must be in [0, 1), got {dropout_p!r}"
    from . import _ops  # not at import time: _ops imports this module

    if dropout_p and _ops.graph_tracing():
        if not _ops.SEEDED_DROPOUT_AVAILABLE:
            # fwd_dropout draws its seed from torch's generator inside itself, which the
            # compiler does not know: it may merge two dropout calls into one or recompute the
            # forward (activation checkpointing) with another seed, silently. Traced graphs run
            # fwd_dropout_seeded (_ops.call_fwd), which an older build lacks.
            return ("dropout_p > 0 under torch.compile is not supported by this build (its "
                    "extension lacks the op fwd_dropout_seeded; rebuild it, or run the call "
                    "eagerly)")
        from torch._functorch import config as functorch_config

        budget = getattr(functorch_config, "activation_memory_budget", 1.0)
        if budget < 1.0:
            # With a memory budget the min-cut partitioner may recompute the graph's random
            # draw (torch.randint) in the backward, which then regenerates another mask
            # (pytorch/pytorch#190758; torch's own dropout is affected too): silently wrong
            # gradients.
            return (f"dropout_p > 0 under torch.compile with "
                    f"torch._functorch.config.activation_memory_budget = {budget} < 1 is not "
                    f"supported (the partitioner may recompute the random draw in the backward, "
                    f"pytorch/pytorch#190758: the backward would regenerate another mask)")
    return None


def is_kernel_aligned(t: torch.Tensor) -> bool:
    """True if the kernels' 16-byte vector loads can read ``t`` (4-D, BSHD or BHSD view): last
    dimension contiguous, data pointer aligned (not read while torch.compile traces; the C++ op
    checks it at run time), other strides a multiple of 8 elements where the size is not 1."""
    st, sh = t.stride(), t.shape
    if not (st[3] == 1 and (sh[0] == 1 or st[0] % STRIDE_MULTIPLE == 0)
            and (sh[1] == 1 or st[1] % STRIDE_MULTIPLE == 0)
            and (sh[2] == 1 or st[2] % STRIDE_MULTIPLE == 0)):
        return False
    return torch.compiler.is_compiling() or t.data_ptr() % VECTOR_BYTES == 0


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> Tuple[int, int]:
    """``torch.cuda.get_device_capability`` of a CUDA device, cached per device index."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)


_BSHD = "(batch, seqlen, num_heads, head_dim) in BSHD layout"
_BHSD = "(batch, num_heads, seqlen, head_dim) in BHSD layout"
# Appended to the BHSD head-count errors: BSHD tensors passed to flash_attention_forward read
# seqlen as num_heads, and this is where that usually surfaces.
_BHSD_HINT = (" (heads are dim 1 in the BHSD layout (batch, num_heads, seqlen, head_dim); for "
              "BSHD tensors use flash_attn_func)")
_QKV = ("q", "k", "v")
_STRIDED = torch.strided


def _tensor_reason(name: str, t: object, q: torch.Tensor, nq: str, dims: str) -> Optional[str]:
    if not isinstance(t, torch.Tensor):
        return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if t.is_nested:
        return (f"{name} is a nested tensor; a dense 4-D tensor {dims} is required (pad the "
                f"sequences, or pass per-batch key ranges with leftpad_k / seqused_k to the op)")
    if t.layout != torch.strided:
        return (f"{name} must be a strided (dense) tensor, got {t.layout}; convert it with "
                f"{name}.to_dense()")
    if t.dim() != 4:
        return f"{name} must be 4-D {dims}, got {t.dim()}-D of shape {list(t.shape)}"
    if t.dtype not in DTYPES:
        return (f"{name} must be float16 (SM75 tensor cores have no bf16/fp32 MMA), "
                f"got {t.dtype}")
    if t.device != q.device:
        return f"{name} must be on the same device as {nq} ({q.device}), got {t.device}"
    if t.stride(-1) != 1:
        return (f"{name} must have a contiguous last dimension (stride(-1) == 1), "
                f"got strides {list(t.stride())}")
    return None


def _key_range_reason(name: str, t: object, q: torch.Tensor) -> Optional[str]:
    if not isinstance(t, torch.Tensor):
        return f"{name} must be a torch.Tensor or None, got {type(t).__name__}"
    if t.layout != torch.strided:
        return f"{name} must be a strided (dense) tensor, got {t.layout}"
    if t.dtype != KEY_RANGE_DTYPE:
        return f"{name} must be int32, got {t.dtype}"
    if not (t.dim() == 1 and t.shape[0] == q.shape[0]):
        return f"{name} must have shape (batch,) = ({q.shape[0]},), got {list(t.shape)}"
    if t.device != q.device:
        return f"{name} must be on the same device as q ({q.device}), got {t.device}"
    if not t.is_contiguous():
        return f"{name} must be contiguous"
    return None


# ---------------------------------------------------------------------------------- the check
def not_supported_reason(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    *,
    layout: str = "bshd",
    devices: Sequence[str] = ("cuda", "cpu", "meta"),
    check_alignment: bool = True,
    names: Sequence[str] = _QKV,
    window_size: Sequence[int] = NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    attn_bias: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
) -> Optional[str]:
    """None if the kernels accept these inputs, else the first rule they break, as a sentence
    that names the argument and the accepted values.

    Reads metadata only (shape, dtype, device, strides, data pointer), never tensor values; no
    host synchronisation, traceable by torch.compile (which skips the data pointer and the
    compute capability: the C++ op checks both at run time).

    Parameters
    ----------
    q, k, v : torch.Tensor
        ``layout="bshd"``: ``(batch, seqlen, num_heads, head_dim)``; ``"bhsd"``: ``(batch,
        num_heads, seqlen, head_dim)`` (the rules are the same; only the head dimension and the
        words of the messages differ).
    softmax_scale : float, optional
        None (``1 / sqrt(head_dim)``) or a real number in [1.18e-38, 1.07e26].
    leftpad_k, seqused_k : torch.Tensor, optional
        Per-batch key range, int32 ``(batch,)`` on q's device.
    devices : sequence of str
        Device types the caller can run: ``("cuda", "cpu", "meta")`` for the op (it has a CPU
        reference and a fake), ``("cuda",)`` for doors that fall back for anything else.
    check_alignment : bool
        Apply the 16-byte vector rule to CUDA tensors (False for a caller that copies misaligned
        tensors itself, see :func:`is_kernel_aligned`).
    names : sequence of 3 or 4 str
        How the messages call q, k, v and (optionally; default ``softmax_scale``) the scale:
        ``("query", "key", "value", "scale")`` in the SDPA wrapper.
    window_size : pair of int
        flash-attn's sliding window ``(left, right)``, each -1 (no limit) or >= 0
        (:func:`window_size_problem`).
    softcap : float
        flash-attn's logit soft-cap, finite and >= 0 (0: off) (:func:`softcap_problem`), with
        softcap / softmax_scale in [2^-100, 2^100] (:func:`softcap_scale_problem`).
    alibi_slopes : torch.Tensor, optional
        flash-attn's ALiBi slopes, float32 ``(num_heads,)`` or ``(batch, num_heads)``, not with
        key ranges (:func:`alibi_slopes_problem`).
    attn_bias : torch.Tensor, optional
        An additive bias or boolean mask broadcasting to ``(batch, num_heads, seqlen_q,
        seqlen_k)`` (:func:`attn_bias_problem`; the backward's limits apply when grad mode is
        on and q, k or v requires grad).
    dropout_p : float
        Attention dropout probability in [0, 1) (:func:`dropout_problem`; no head dim limit).
    """
    bhsd = layout == "bhsd"
    if not (isinstance(q, torch.Tensor) and not q.is_nested and q.layout is _STRIDED):
        return _tensor_reason(names[0], q, q, names[0], _BHSD if bhsd else _BSHD)
    dev = q.device
    dev_type = dev.type
    # The device first: a door that runs CUDA only says so before anything else.
    if dev_type not in devices:
        alt = " (or CPU for the reference implementation)" if "cpu" in devices else ""
        return f"{names[0]} must be a CUDA tensor{alt}, got device {dev}"
    # _tensor_reason's rules, inlined for the common (valid) call; it words the failure.
    for t in (q, k, v):
        if not (isinstance(t, torch.Tensor) and not t.is_nested and t.layout is _STRIDED
                and t.dim() == 4 and t.dtype in DTYPES and (t is q or t.device == dev)
                and t.stride()[3] == 1):
            name = names[0] if t is q else names[1] if t is k else names[2]
            return _tensor_reason(name, t, q, names[0], _BHSD if bhsd else _BSHD)
    nq, nk, nv = names[:3]

    qs, ks = q.shape, k.shape
    if ks != v.shape:
        return (f"{nk} and {nv} must have the same shape, got {nk} {list(ks)} and {nv} "
                f"{list(v.shape)}" + (_VALUE_HEAD_DIM if ks[3] != v.shape[3] else ""))
    if ks[0] != qs[0]:
        return f"{nq} and {nk} must have the same batch size, got {qs[0]} and {ks[0]}"
    d = qs[3]
    if ks[3] != d:
        return f"{nq} and {nk} must have the same head_dim, got {d} and {ks[3]}"
    if not is_head_dim(d):
        return f"head_dim must be {_HEAD_DIM_RULE}, got {d}"
    hd = 1 if bhsd else 2
    h, h_k = qs[hd], ks[hd]
    # Zero-size inputs are valid (empty or zero result, no launch), but q heads need kv heads.
    if h_k == 0:
        if h != 0:
            return (f"num_heads_k must be >= 1 when num_heads >= 1 (GQA/MQA: num_heads must be "
                    f"a multiple of num_heads_k), got num_heads_k 0 and num_heads {h}"
                    + _BHSD_HINT * bhsd)
    elif h % h_k != 0:
        return (f"num_heads ({h}) must be a multiple of num_heads_k ({h_k}) for GQA/MQA"
                + _BHSD_HINT * bhsd)
    for extent in (qs[0], qs[1], qs[2], ks[0], ks[1], ks[2]):  # not max(): torch 2.6's dynamo
        if extent > MAX_EXTENT:                                  # cannot trace max() of SymInts
            return "batch, seqlen and heads must each be < 2^31"
    if leftpad_k is not None:
        r = _key_range_reason("leftpad_k", leftpad_k, q)
        if r is not None:
            return r
    if seqused_k is not None:
        r = _key_range_reason("seqused_k", seqused_k, q)
        if r is not None:
            return r
    if softmax_scale is not None and (type(softmax_scale) is not float
                                      or not SOFTMAX_SCALE_MIN <= softmax_scale <= SOFTMAX_SCALE_MAX):
        r = scale_problem(softmax_scale, names[3] if len(names) > 3 else "softmax_scale")
        if r is not None:
            return r
    if torch.compiler.is_compiling() or window_size is not NO_WINDOW:  # see window_size_problem
        r = window_size_problem(window_size)
        if r is not None:
            return r
    # A float 0.0 <= softcap < inf passes without the call (the common, valid case); a numpy
    # scalar, an int or a SymFloat under torch.compile takes the full check, which traces.
    if type(softcap) is not float or not 0.0 <= softcap < math.inf:
        r = softcap_problem(softcap)
        if r is not None:
            return r
    if type(softcap) is not float or softcap != 0.0:
        r = softcap_scale_problem(softcap, softmax_scale, d,
                                  names[3] if len(names) > 3 else "softmax_scale")
        if r is not None:
            return r
    if alibi_slopes is not None:
        r = alibi_slopes_problem(alibi_slopes, dev, qs[0], h,
                                 leftpad_k is not None or seqused_k is not None)
        if r is not None:
            return r
    if attn_bias is not None:
        r = attn_bias_problem(
            attn_bias, q, ks[3 - hd], layout=layout, softcap=softcap,
            backward=backward_may_follow(q, k, v, dropout_p=dropout_p),
            softmax_scale=softmax_scale, scale_name=names[3] if len(names) > 3 else "softmax_scale")
        if r is not None:
            return r
    if type(dropout_p) is not float or dropout_p != 0.0:
        r = dropout_problem(dropout_p)
        if r is not None:
            return r

    if dev_type == "cuda":
        if check_alignment:
            for name, t in ((nq, q), (nk, k), (nv, v)):
                if not is_kernel_aligned(t):
                    return (f"{name} must be 16-byte aligned with batch/seq/head strides "
                            f"divisible by 8 elements, got strides {list(t.stride())}")
        if not torch.compiler.is_compiling():
            cap = device_capability(dev)
            if cap < MIN_COMPUTE_CAPABILITY:
                return (f"needs a GPU of compute capability >= 7.5 (Turing or newer), got "
                        f"{cap[0]}.{cap[1]}")
    return None


def check_inputs(q, k, v, softmax_scale=None, leftpad_k=None, seqused_k=None, *,
                 layout: str = "bshd", window_size: Sequence[int] = NO_WINDOW,
                 softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
                 attn_bias: Optional[torch.Tensor] = None, dropout_p: float = 0.0) -> None:
    """Raise ``ValueError("flash_attention_sm75: <reason>")`` for inputs the kernels do not accept
    (:func:`not_supported_reason` with the op's devices: CUDA, CPU reference, meta), before any
    launch. ``layout`` is ``"bshd"`` (the op's own) or ``"bhsd"``."""
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"{PREFIX}layout must be 'bshd' or 'bhsd', got {layout!r}")
    reason = not_supported_reason(q, k, v, softmax_scale, leftpad_k, seqused_k, layout=layout,
                                  window_size=window_size, softcap=softcap,
                                  alibi_slopes=alibi_slopes, attn_bias=attn_bias,
                                  dropout_p=dropout_p)
    if reason is not None:
        raise ValueError(PREFIX + reason)
