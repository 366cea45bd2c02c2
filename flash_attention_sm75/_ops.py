"""Loads the compiled op library and registers its Python-side pieces.

``import flash_attention_sm75._C`` runs the C++ static registrars (``TORCH_LIBRARY``), which
define ``torch.ops.flash_attention_sm75.fwd`` with CUDA and CPU implementations. This module adds
what is registered from Python:

* a fake (meta) implementation, used by ``torch.compile``/``torch.export``/``FakeTensorMode``,
  which validates the inputs with ``torch._check_value`` (the rules and messages of the C++
  ``check_fwd_inputs``) and allocates exactly what the C++ allocates;
* autograd: the formula of ``_backward.register_backward`` (through the ``bwd`` op) when the
  built library has that op, otherwise a stub whose backward raises ``NotImplementedError``
  (without any registration PyTorch's fallback would silently return wrong gradients);
* :func:`validate_fwd_inputs`, the eager validation used by the public functions before they call
  the op, raising ``ValueError`` that names the argument and the accepted values;
* :func:`call_fwd`, how the public functions call the op: below its autograd kernel when no
  gradient can flow.

See docs/CONTRACT.md for the op contract.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Optional

import torch
import torch.autograd.forward_ad as _forward_ad

__all__ = [
    "EXTENSION_AVAILABLE",
    "EXTENSION_ERROR",
    "HAS_BACKWARD",
    "SUPPORTED_HEAD_DIMS",
    "call_fwd",
    "validate_fwd_inputs",
]

try:
    from . import _C  # noqa: F401  (registers torch.ops.flash_attention_sm75.*)

    EXTENSION_AVAILABLE: bool = True
    EXTENSION_ERROR: Optional[str] = None
except ImportError as e:  # not built, or built against another torch/CUDA
    EXTENSION_AVAILABLE = False
    EXTENSION_ERROR = f"{type(e).__name__}: {e}"

# True when the autograd formula of flash_attention_sm75::fwd (through the bwd op, see
# _backward.py) is registered; False when the built library has no bwd op, in which case a stub
# makes backward raise NotImplementedError.
HAS_BACKWARD: bool = False

SUPPORTED_HEAD_DIMS = (64, 128)

_PREFIX = "flash_attention_sm75: "
_INT32_MAX = 2**31 - 1
# softmax_scale must survive the kernel's float32 arithmetic for every float16 input: normal in
# float32 (a denormal scale is flushed to 0 by --use_fast_math), and small enough that the
# largest possible score, scale * log2(e) * q.k with |q.k| <= 128 * 65504^2 (head_dim 128, fp16
# max), stays finite with a factor 2 of headroom: at exactly FLT_MAX / (log2(e) * 128 * 65504^2)
# the float32 roundings of scale * log2(e) and of the product give inf (rn(rn(scale * log2(e))
# * 128 * 65504^2) = inf), and an inf score gives inf - inf = NaN in the softmax. The C++
# check_fwd_inputs uses the same bounds.
SOFTMAX_SCALE_MIN = 1.1754943508222875e-38  # FLT_MIN
SOFTMAX_SCALE_MAX = 3.4028234663852886e38 / (2 * 1.4426950408889634 * 128 * 65504.0**2)  # ~2.15e26
_SCALE_RANGE = "[1.2e-38, 2.1e26]"


def type_name(obj: object) -> str:
    """``obj``'s type for error messages: qualified outside builtins, so that e.g. numpy's
    ``np.bool_`` (whose ``__name__`` is ``bool``) reads ``numpy.bool`` and not ``bool``."""
    t = type(obj)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def require_bool(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is a bool (``causal=0.125``, a scale passed in the
    wrong slot, must not silently mean True); ``name`` is the argument as the caller wrote it."""
    if not isinstance(value, bool):
        raise ValueError(f"{_PREFIX}{name} must be a bool (True or False), "
                         f"got {type_name(value)} {value!r}")


def scale_problem(softmax_scale: object) -> Optional[str]:
    """None if ``softmax_scale`` (not None) is a usable scale, else what is wrong with it."""
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        return (f"softmax_scale must be a real number (float or int), got "
                f"{type_name(softmax_scale)} {softmax_scale!r}")
    s = float(softmax_scale)
    if not (math.isfinite(s) and SOFTMAX_SCALE_MIN <= s <= SOFTMAX_SCALE_MAX):
        return (f"softmax_scale must be a finite number > 0 within {_SCALE_RANGE} (float32 "
                f"scores must not overflow), got {softmax_scale!r}")
    return None


def _shape(t: torch.Tensor) -> list:
    # Printed like the C++ IntArrayRef: [1, 2, 3]
    return list(t.shape)


def _strides(t: torch.Tensor) -> list:
    return list(t.stride())


# Appended to the BHSD head-count error: BSHD tensors passed to flash_attention_forward read
# seqlen as num_heads, and this is where that usually surfaces. (The BSHD message stays the C++
# op's, which test_ops compares word for word.)
_BHSD_HINT = (" (heads are dim 1 in the BHSD layout (batch, num_heads, seqlen, head_dim); for "
              "BSHD tensors use flash_attn_func)")


def _validate(
    check: Callable[[object, Callable[[], str]], None],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float],
    leftpad_k: Optional[torch.Tensor],
    seqused_k: Optional[torch.Tensor],
    layout: str,
    check_alignment: bool,
) -> None:
    """The op's input rules, in the order of the C++ ``check_fwd_inputs`` + ``mha_fwd``.

    ``check(cond, msg)`` raises ``ValueError(msg())`` when ``cond`` is false. ``layout`` ("bshd"
    or "bhsd") only changes how shapes are described; the tensors are the caller's own.
    """
    if layout == "bshd":
        dims = "(batch, seqlen, num_heads, head_dim) in BSHD layout"
        head_dim_ = 2
    else:
        dims = "(batch, num_heads, seqlen, head_dim) in BHSD layout"
        head_dim_ = 1

    for name, t in (("q", q), ("k", k), ("v", v)):
        check(isinstance(t, torch.Tensor),
              lambda: f"{_PREFIX}{name} must be a torch.Tensor, got {type(t).__name__}")
        check(not t.is_nested,
              lambda: f"{_PREFIX}{name} is a nested tensor; a dense 4-D tensor {dims} is "
                      f"required (pad the sequences, or pass per-batch key ranges with "
                      f"leftpad_k / seqused_k to the op)")
        check(t.layout == torch.strided,
              lambda: f"{_PREFIX}{name} must be a strided (dense) tensor, got {t.layout}; "
                      f"convert it with {name}.to_dense()")
        check(t.dim() == 4,
              lambda: f"{_PREFIX}{name} must be 4-D {dims}, got {t.dim()}-D of shape {_shape(t)}")
        check(t.dtype == torch.float16,
              lambda: f"{_PREFIX}{name} must be float16 (SM75 tensor cores have no bf16/fp32 MMA), "
                      f"got {t.dtype}")
        check(t.device == q.device,
              lambda: f"{_PREFIX}{name} must be on the same device as q ({q.device}), got {t.device}")
        check(t.stride(-1) == 1,
              lambda: f"{_PREFIX}{name} must have a contiguous last dimension (stride(-1) == 1), "
                      f"got strides {_strides(t)}")

    check(k.shape == v.shape,
          lambda: f"{_PREFIX}k and v must have the same shape, got k {_shape(k)} and v {_shape(v)}")
    check(k.shape[0] == q.shape[0],
          lambda: f"{_PREFIX}q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    check(k.shape[3] == q.shape[3],
          lambda: f"{_PREFIX}q and k must have the same head_dim, got {q.shape[3]} and {k.shape[3]}")
    d = q.shape[3]
    check(d == 64 or d == 128, lambda: f"{_PREFIX}head_dim must be 64 or 128, got {d}")
    h, h_k = q.shape[head_dim_], k.shape[head_dim_]
    # Zero-size inputs are valid (empty or zero result, no launch), but q heads need kv heads.
    check(h_k > 0 or h == 0,
          lambda: f"{_PREFIX}num_heads_k must be >= 1 when num_heads >= 1 (GQA/MQA: num_heads "
                  f"must be a multiple of num_heads_k), got num_heads_k 0 and num_heads {h}"
                  + _BHSD_HINT * (layout == "bhsd"))
    check(h_k == 0 or h % h_k == 0,
          lambda: f"{_PREFIX}num_heads ({h}) must be a multiple of num_heads_k ({h_k}) for GQA/MQA"
                  + _BHSD_HINT * (layout == "bhsd"))
    for t in (q, k):
        for i in range(3):
            check(t.shape[i] <= _INT32_MAX,
                  lambda: f"{_PREFIX}batch, seqlen and heads must each be < 2^31")

    for name, t in (("leftpad_k", leftpad_k), ("seqused_k", seqused_k)):
        if t is None:
            continue
        check(isinstance(t, torch.Tensor),
              lambda: f"{_PREFIX}{name} must be a torch.Tensor or None, got {type(t).__name__}")
        check(t.layout == torch.strided,
              lambda: f"{_PREFIX}{name} must be a strided (dense) tensor, got {t.layout}")
        check(t.dtype == torch.int32, lambda: f"{_PREFIX}{name} must be int32, got {t.dtype}")
        check(t.dim() == 1 and t.shape[0] == q.shape[0],
              lambda: f"{_PREFIX}{name} must have shape (batch,) = ({q.shape[0]},), got {_shape(t)}")
        check(t.device == q.device,
              lambda: f"{_PREFIX}{name} must be on the same device as q ({q.device}), got {t.device}")
        check(t.is_contiguous(), lambda: f"{_PREFIX}{name} must be contiguous")

    if softmax_scale is not None:
        problem = scale_problem(softmax_scale)
        check(problem is None, lambda: f"{_PREFIX}{problem}")

    if check_alignment and q.device.type == "cuda":
        for name, t in (("q", q), ("k", k), ("v", v)):
            # data_ptr() cannot be traced by torch.compile; the C++ op re-checks it at run time.
            ptr_ok = torch.compiler.is_compiling() or t.data_ptr() % 16 == 0
            ok = ptr_ok and all(t.shape[i] == 1 or t.stride(i) % 8 == 0 for i in range(3))
            check(ok, lambda: f"{_PREFIX}{name} must be 16-byte aligned with batch/seq/head strides "
                              f"divisible by 8 elements, got strides {_strides(t)}")


def _passes_all_rules(q, k, v, softmax_scale, head_dim_: int) -> bool:
    """True only if ``_validate`` (with the alignment rule) would accept these inputs: the same
    rules as one flat expression, without building a message closure per rule, so valid calls
    (the common case) cost a few microseconds of host time instead of ~30 checks. Any doubt
    returns False and the caller runs ``_validate``, which names the broken rule. Not for
    torch.compile tracing (uses ``data_ptr``) or ``leftpad_k``/``seqused_k``."""
    try:
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
                and isinstance(v, torch.Tensor)):
            return False
        if not (q.dim() == 4 and k.dim() == 4 and v.dim() == 4):
            return False
        f16 = torch.float16
        if not (q.dtype == f16 and k.dtype == f16 and v.dtype == f16):
            return False
        dev = q.device
        if not (dev.type in ("cuda", "cpu", "meta") and k.device == dev and v.device == dev):
            return False
        qs, ks = q.shape, k.shape
        if ks != v.shape:
            return False
        # Also rejects every sparse layout, without a layout check per call: sparse COO
        # tensors report strides of 0, the compressed layouts raise (-> except -> False).
        if not (q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1):
            return False
        # Zero-size dimensions are valid, except kv heads 0 under q heads >= 1.
        h, h_k = qs[head_dim_], ks[head_dim_]
        if not (ks[0] == qs[0] and ks[3] == qs[3] and qs[3] in (64, 128)
                and (h % h_k == 0 if h_k > 0 else h == 0)):
            return False
        if max(qs[0], qs[1], qs[2], ks[0], ks[1], ks[2]) > _INT32_MAX:
            return False
        if softmax_scale is not None and scale_problem(softmax_scale) is not None:
            return False
        if dev.type == "cuda":
            for t in (q, k, v):
                if t.data_ptr() % 16 != 0:
                    return False
                st, sh = t.stride(), t.shape
                if not ((sh[0] == 1 or st[0] % 8 == 0) and (sh[1] == 1 or st[1] % 8 == 0)
                        and (sh[2] == 1 or st[2] % 8 == 0)):
                    return False
        return True
    except Exception:  # anything unexpected: let _validate produce the message
        return False


def _raise_value_error(cond: object, msg: Callable[[], str]) -> None:
    if not cond:
        raise ValueError(msg())


def validate_fwd_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    layout: str = "bshd",
) -> None:
    """Raise ``ValueError`` (naming the argument and the accepted values) for input the op rejects.

    Checks everything the C++ ``check_fwd_inputs`` checks, plus the CUDA alignment rule (16-byte
    aligned data pointer, batch/seq/head strides divisible by 8), in the same order and with the
    same messages, so no kernel is launched on bad input. ``layout`` is ``"bshd"`` (the op's own
    layout) or ``"bhsd"`` (tensors as passed to :func:`flash_attention_forward`); the rules are the
    same, only the dimension names in the messages differ.
    """
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"{_PREFIX}layout must be 'bshd' or 'bhsd', got {layout!r}")
    if (leftpad_k is None and seqused_k is None and not torch.compiler.is_compiling()
            and _passes_all_rules(q, k, v, softmax_scale, 2 if layout == "bshd" else 1)):
        return
    if isinstance(q, torch.Tensor) and q.device.type not in ("cuda", "cpu", "meta"):
        raise ValueError(f"{_PREFIX}q must be a CUDA tensor (or CPU for the reference "
                         f"implementation), got device {q.device}")
    _validate(_raise_value_error, q, k, v, softmax_scale, leftpad_k, seqused_k, layout,
              check_alignment=True)


def forward_ad_input(q, k, v) -> Optional[str]:
    """Name of the first of q, k, v that carries a forward-mode AD tangent, else None.

    Forward-mode AD (``torch.func.jvp``, ``torch.autograd.forward_ad``) has no formula for the
    op: without a check its tangent would silently come back as zeros or be dropped. Outside a
    dual level (the common case) this costs one attribute read.
    """
    if getattr(_forward_ad, "_current_level", 0) < 0:
        return None
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None:
            return name
    return None


def functorch_grad_active() -> bool:
    """True inside a ``torch.func`` reverse-mode transform (``grad``, ``vjp``, ``jacrev``,
    ``grad_and_value``): the innermost functorch interpreter is a Grad transform. Callers
    test ``torch._C._are_functorch_transforms_active()`` first (outside transforms this is
    never needed).

    The op's autograd formula comes from ``torch.library.register_autograd``, which torch.func's
    reverse-mode transforms do not support (torch raises an error about an autograd.Function
    without ``setup_context``). ``vmap`` alone works (per-sample fallback).
    """
    top = torch._C._functorch.peek_interpreter_stack()
    return top is not None and top.key() == torch._C._functorch.TransformType.Grad


def call_fwd(q, k, v, softmax_scale, is_causal, causal_bottom_right, leftpad_k=None,
             seqused_k=None):
    """``torch.ops.flash_attention_sm75.fwd(q, k, v, softmax_scale, is_causal,
    causal_bottom_right, leftpad_k, seqused_k)``, skipping the op's autograd kernel when no
    gradient can flow.

    The autograd kernel (``torch.library.register_autograd``, see ``_backward.py``) is Python and
    runs on every call: even with no input requiring grad it costs ~8 us of host time (boxing into
    Python, a metadata object, ``op.redispatch``) before doing exactly what this fast path does,
    dispatching below autograd (benchmarks/NOTES.md, "Host overhead"). The plain call is kept

    * when grad mode is on and an input requires grad: the autograd formula must run;
    * while torch.compile / torch.export trace: the graph gets the plain op;
    * under functorch transforms (``torch.func.grad``, ``vmap``), which manage the autograd
      dispatch keys themselves;
    * while a ``__torch_function__`` mode is active: it runs inside the op call and may add
      tensors that require grad (or compute with them), which the guard would hide from autograd.

    Raises ``NotImplementedError`` for inputs carrying a forward-mode AD tangent (no jvp formula;
    the tangent would otherwise be silently wrong) and inside ``torch.func.grad`` / ``vjp`` /
    ``jacrev`` (see ``functorch_grad_active``), before the op runs.
    """
    name = forward_ad_input(q, k, v)
    if name is not None:
        raise NotImplementedError(
            f"flash_attention_sm75: forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) "
            f"is not supported; {name} carries a tangent. Use reverse mode (tensor.backward() "
            f"or torch.autograd.grad; torch.func transforms are not supported either) or "
            f"torch's scaled_dot_product_attention for jvp")
    transforms = torch._C._are_functorch_transforms_active()
    if transforms and functorch_grad_active():
        raise NotImplementedError(
            "flash_attention_sm75: torch.func reverse-mode transforms (grad, vjp, jacrev, "
            "grad_and_value) are not supported: the op's autograd formula is registered with "
            "torch.library.register_autograd, which they cannot use. Use tensor.backward() or "
            "torch.autograd.grad, or flash_attention_sm75.scaled_dot_product_attention, which "
            "falls back to torch's SDPA inside torch.func transforms")
    op = torch.ops.flash_attention_sm75.fwd  # looked up per call: tests spy on this attribute
    if (torch.compiler.is_compiling() or transforms
            or torch._C._is_torch_function_mode_enabled()
            or (torch.is_grad_enabled()
                and (q.requires_grad or k.requires_grad or v.requires_grad))):
        return op(q, k, v, softmax_scale, is_causal, causal_bottom_right, leftpad_k, seqused_k)
    with torch._C._AutoDispatchBelowAutograd():
        return op(q, k, v, softmax_scale, is_causal, causal_bottom_right, leftpad_k, seqused_k)


if EXTENSION_AVAILABLE:

    @torch.library.register_fake("flash_attention_sm75::fwd")
    def _fwd_fake(q, k, v, softmax_scale=None, is_causal=False, causal_bottom_right=True,
                  leftpad_k=None, seqused_k=None):
        # Never reads data; strides are checked (the pointer is not known to a fake).
        def check(cond, msg):
            torch._check_value(cond, msg)

        _validate(check, q, k, v, softmax_scale, leftpad_k, seqused_k, "bshd",
                  check_alignment=False)
        if q.device.type == "cuda":
            for name, t in (("q", q), ("k", k), ("v", v)):
                for i in range(3):
                    torch._check_value(
                        t.shape[i] == 1 or t.stride(i) % 8 == 0,
                        lambda: f"{_PREFIX}{name} must be 16-byte aligned with batch/seq/head "
                                f"strides divisible by 8 elements, got strides {_strides(t)}")
        b, seqlen_q, h, d = q.shape
        # Same as the C++: at::empty({b, sq, h, d}, q.options()) and a float32 (b, h, sq).
        out = q.new_empty((b, seqlen_q, h, d))
        lse = q.new_empty((b, h, seqlen_q), dtype=torch.float32)
        return out, lse

    def _stub_setup_context(ctx, inputs, output):
        pass

    def _stub_backward(ctx, grad_out, grad_lse):
        raise NotImplementedError(
            "flash_attention_sm75: the backward pass is not implemented yet; run the forward "
            "under torch.no_grad()/torch.inference_mode(), or use "
            "flash_attention_sm75.scaled_dot_product_attention, which falls back to "
            "torch.nn.functional.scaled_dot_product_attention when inputs require grad")

    try:
        from ._backward import register_backward
    except ImportError:  # the backward's Python side is not part of this build
        register_backward = None
    if register_backward is not None and register_backward():
        HAS_BACKWARD = True
    else:
        # Without an Autograd kernel PyTorch's fallback lets backward run and returns wrong
        # (missing) gradients with only a warning; this makes backward fail loudly instead.
        torch.library.register_autograd("flash_attention_sm75::fwd", _stub_backward,
                                        setup_context=_stub_setup_context)
