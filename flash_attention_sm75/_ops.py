"""The op's Python side: loading the compiled library, the fake implementations, autograd, and
the one entry every door calls the op through.

``import flash_attention_sm75._C`` runs the C++ static registrars (``TORCH_LIBRARY``), which
define ``torch.ops.flash_attention_sm75.fwd`` and ``bwd`` (padded BSHD batches) and
``varlen_fwd`` and ``varlen_bwd`` (flash-attn's packed varlen layout: ``(total, heads,
head_dim)`` tokens split by ``cu_seqlens``), their dropout forms (``fwd_dropout``,
``fwd_dropout_seeded``, ``varlen_fwd_dropout``), with CUDA and CPU implementations
(docs/CONTRACT.md). This module registers, side by side for both pairs:

* the fakes of ``fwd`` / ``bwd`` / ``varlen_fwd`` / ``varlen_bwd`` (``torch.compile`` /
  ``torch.export`` / FakeTensorMode): shape checks only (``torch._check``) and exactly the
  allocations of the C++; what the kernels accept is the rulebook's business (``_rules.py``),
  asked by every door before the op is called;
* the autograd formulas of ``fwd`` and ``varlen_fwd``: they save ``q, k, v, out, softmax_lse``
  (and the varlen metadata; O(N) memory, no attention matrix) and call ``bwd`` /
  ``varlen_bwd``; a gradient flowing into ``softmax_lse`` (returned with ``return_lse=True``,
  ``return_attn_probs=True``) is passed on as ``grad_softmax_lse`` and handled exactly. The
  backward ops themselves have no formula: double backward raises;
* :func:`call_fwd` and :func:`call_varlen_fwd`, how the doors call the ops;
* the backward's determinism switch (:func:`deterministic_backward`), and
  ``flash_attention_sm75::fwd_deterministic_bwd`` / ``varlen_fwd_deterministic_bwd``,
  Python-defined twins of ``fwd`` / ``varlen_fwd`` (same schema, same results) whose autograd
  formula always asks for the deterministic backward: how a call that requests determinism at
  forward time (flash-attn's ``deterministic=True``) carries the request to its backward
  (``call_fwd(deterministic=True)``).

Determinism: by default dQ is computed by a separate kernel with no floating-point atomics, so
the backward is bitwise reproducible (docs/BACKWARD.md). ``FLASH_SM75_BWD_DQ=atomic`` selects
an fp32 atomic dQ accumulator (not reproducible bit for bit); it is ignored when
``torch.use_deterministic_algorithms(True)`` is in effect or inside
:func:`deterministic_backward` when the backward runs, and for the backward of a forward called
with ``call_fwd(deterministic=True)``.
"""
from __future__ import annotations

import contextlib
import importlib
import math
import os
import threading
import warnings
from typing import Iterator, Optional

import torch
import torch.autograd.forward_ad as _forward_ad

from ._rules import _SLOPES_GRAD, require_bool

__all__ = [
    "EXTENSION_AVAILABLE",
    "EXTENSION_ERROR",
    "KVCACHE_AVAILABLE",
    "PAGE_BLOCK_MULTIPLE",
    "VARLEN_AVAILABLE",
    "VARLEN_DROPOUT_AVAILABLE",
    "autograd_reason",
    "call_fwd",
    "call_kvcache_fwd",
    "call_varlen_fwd",
    "deterministic_backward",
    "is_deterministic_backward",
]


def _built_for_other_torch() -> Optional[str]:
    """The torch the extension was compiled against, when it is not the running one (setup.py
    writes ``_build_info.py`` beside ``_C``; no such file, or the same torch, gives None)."""
    try:
        from ._build_info import TORCH_VERSION as built
    except ImportError:
        return None
    return None if built == torch.__version__ else built


BUILD_HINT = ("build it with `pip install --no-build-isolation .` at the repository root "
              "(README: Set-up)")

_C_NAME = __name__.rpartition(".")[0] + "._C"
try:
    # import_module, not `from . import _C`: this runs while the package itself is still being
    # imported, and Python words a missing _C there as "cannot import name '_C' from partially
    # initialized module ... (most likely due to a circular import)", which misleads.
    importlib.import_module(_C_NAME)  # registers torch.ops.flash_attention_sm75.*

    EXTENSION_AVAILABLE: bool = True
    EXTENSION_ERROR: Optional[str] = None
except ModuleNotFoundError as e:
    if e.name != _C_NAME:  # a module that _C needs: not ours to word
        raise
    EXTENSION_AVAILABLE = False
    EXTENSION_ERROR = (f"the extension is not built: no compiled library {_C_NAME} in "
                       f"{os.path.dirname(os.path.abspath(__file__))}")
except ImportError as e:  # built against another torch/CUDA, a missing shared library, ...
    EXTENSION_AVAILABLE = False
    EXTENSION_ERROR = f"{type(e).__name__}: {e}"
_built = _built_for_other_torch()
if _built is not None:
    _mismatch = (f"flash_attention_sm75: the extension was built against torch {_built}, this is "
                 f"torch {torch.__version__}; rebuild it with the torch you run: "
                 f"`pip install --no-build-isolation .` in the source tree")
    if EXTENSION_AVAILABLE:  # it loaded, but torch's C++ ABI differs between releases
        warnings.warn(_mismatch, RuntimeWarning, stacklevel=2)
    else:
        EXTENSION_ERROR += f" ({_mismatch})"


def require_extension() -> None:
    """Raise ``RuntimeError`` with the build command when the compiled library is missing."""
    if not EXTENSION_AVAILABLE:
        raise RuntimeError(
            "flash_attention_sm75: the compiled extension flash_attention_sm75._C could not be "
            f"imported ({EXTENSION_ERROR}); {BUILD_HINT}")


# Set by deterministic_backward(), process-wide: PyTorch runs the backward of CUDA tensors on its
# autograd device threads, which a thread-local setting of the caller's thread would not reach.
_forced: Optional[bool] = None
_forced_lock = threading.Lock()


@contextlib.contextmanager
def deterministic_backward(enabled: bool = True) -> Iterator[None]:
    """Within the block, backward passes run in deterministic mode (``enabled=False``: they
    follow ``FLASH_SM75_BWD_DQ`` even under ``torch.use_deterministic_algorithms(True)``).

    The setting is read when the backward runs (``loss.backward()``), not when the forward runs,
    and it is process-wide while the block runs: the backward of CUDA tensors runs on PyTorch's
    autograd device threads, not on the thread that called ``backward()``. Blocks entered on
    several threads at once with different settings race (the last one entered wins).

    Raises ``ValueError`` if ``enabled`` is not a bool.
    """
    require_bool("deterministic_backward(enabled)", enabled)
    global _forced
    with _forced_lock:
        prev, _forced = _forced, enabled
    try:
        yield
    finally:
        with _forced_lock:
            _forced = prev


# The package's on / off environment variables (FLASH_ATTENTION_SM75_SDPA, _STRICT) read these
# spellings, case and surrounding blanks ignored.
TRUE_STRINGS = ("1", "true", "yes", "on")
FALSE_STRINGS = ("", "0", "false", "no", "off")


def env_choice(name: str, choices: dict) -> object:
    """``choices[value]`` for environment variable ``name`` (unset reads as ``""``; case and
    surrounding blanks ignored). Raises ``ValueError`` naming the variable, its value as set
    and the values accepted, for any other value."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value not in choices:
        shown = sorted(c for c in choices if c)
        raise ValueError(f"flash_attention_sm75: environment variable {name}={raw!r} is not "
                         f"understood; use one of {shown} or leave it unset")
    return choices[value]


def env_flag(name: str) -> bool:
    """An on / off environment variable: :data:`TRUE_STRINGS` on, :data:`FALSE_STRINGS` or
    unset off, anything else ``ValueError`` (:func:`env_choice`)."""
    return env_choice(name, {**dict.fromkeys(TRUE_STRINGS, True),
                             **dict.fromkeys(FALSE_STRINGS, False)})


def _deterministic_forced() -> bool:
    """The backward op's ``deterministic`` argument: inside :func:`deterministic_backward`, its
    setting; else ``torch.are_deterministic_algorithms_enabled()``."""
    flag = _forced
    if flag is not None:
        return flag
    return torch.are_deterministic_algorithms_enabled()


def is_deterministic_backward() -> bool:
    """True if the next CUDA backward runs without floating-point atomics (bitwise
    reproducible): always, unless ``FLASH_SM75_BWD_DQ=atomic`` selects fp32 atomics for dQ and
    neither :func:`deterministic_backward` nor ``torch.use_deterministic_algorithms(True)``
    forces the separate dQ kernel. (The CPU backward is always deterministic; the CUDA backward
    rejects other values of ``FLASH_SM75_BWD_DQ`` with ``ValueError`` when it runs.)"""
    return _deterministic_forced() or os.environ.get("FLASH_SM75_BWD_DQ", "") != "atomic"


def forward_ad_input(q, k, v, attn_bias=None, bias_name: str = "attn_bias") -> Optional[str]:
    """Name of the first of q, k, v (and ``attn_bias``, as ``bias_name``) that carries a
    forward-mode AD tangent, else None.

    Forward-mode AD (``torch.func.jvp``, ``torch.autograd.forward_ad``) has no formula for the
    op: without a check its tangent would silently come back as zeros or be dropped. Outside a
    dual level (the common case) this costs one attribute read.
    """
    if getattr(_forward_ad, "_current_level", 0) < 0:
        return None
    for name, t in (("q", q), ("k", k), ("v", v), (bias_name, attn_bias)):
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


def autograd_reason(q, k, v, *, any_transform: bool = False, attn_bias=None,
                    bias_name: str = "attn_bias") -> Optional[str]:
    """Why the op cannot run under the caller's autograd mode, or None: an input (q, k, v, or
    the door's bias / mask ``attn_bias``, named ``bias_name``) carrying a forward-mode AD
    tangent (no jvp formula), a ``torch.func`` reverse-mode transform (the formula is
    ``register_autograd``'s, which they cannot use), or with ``any_transform`` any active
    ``torch.func`` transform (for doors whose fallback has batching rules)."""
    name = forward_ad_input(q, k, v, attn_bias, bias_name)
    if name is not None:
        return (f"{name} carries a forward-mode AD tangent (torch.func.jvp / forward_ad); the op "
                f"has no jvp formula")
    if torch._C._are_functorch_transforms_active() and (any_transform or functorch_grad_active()):
        return ("a torch.func transform (grad, vjp, jacrev, vmap, ...) is active: the op's "
                "autograd formula does not support torch.func")
    return None


def graph_tracing() -> bool:
    """True while a graph is traced: torch.compile / torch.export (dynamo), and traces without
    dynamo that AOTAutograd's partitioner may still rewrite (``make_fx``,
    ``functorch.compile.aot_function``: a proxy, fake or functional dispatch mode is active).
    A random draw inside an op is invisible to such a graph."""
    return torch.compiler.is_compiling() or _dispatch_mode_tracing()


def call_fwd(q, k, v, softmax_scale, is_causal, causal_bottom_right, leftpad_k=None,
             seqused_k=None, window_size_left=-1, window_size_right=-1, softcap=0.0,
             alibi_slopes=None, attn_bias=None, *, deterministic: bool = False,
             dropout_p: float = 0.0, bhsd_inputs: bool = False):
    """``torch.ops.flash_attention_sm75.fwd(q, k, v, softmax_scale, is_causal,
    causal_bottom_right, leftpad_k, seqused_k, window_size_left, window_size_right, softcap,
    alibi_slopes, attn_bias)``, skipping the op's autograd kernel when no gradient can flow.
    ``attn_bias`` is passed only when given (an extension built before it still runs the
    rest). ``bhsd_inputs=True``: q, k, v are ``(batch, heads, seq, head_dim)`` (the BHSD doors),
    passed to the op as ``transpose(1, 2)`` views (inside the eager autograd function, where
    autograd records no view; the gradients come back BHSD); the results are the op's (``out``
    BSHD).

    ``deterministic=True`` (flash-attn's per-call flag) makes this call's backward
    deterministic whatever the global setting is when it runs: where autograd records the call,
    it goes through the twin op ``fwd_deterministic_bwd`` (same schema and results), whose
    saved context asks ``bwd`` for ``deterministic=True``. (The op's schema has no such argument,
    and a flag read from Python state in ``setup_context`` would be frozen into compiled graphs
    unguarded; an op of its own is what torch.compile traces and keeps.) Without it, the backward
    follows :func:`deterministic_backward` / ``torch.use_deterministic_algorithms`` as read when
    it runs.

    The autograd kernel (``torch.library.register_autograd``, below in this module) is Python and
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
    ``jacrev`` (see ``functorch_grad_active``), and ``ValueError`` for ``alibi_slopes`` that
    require grad while grad mode is on (the op has no slope gradient; flash-attn's none either,
    and a silent zero would be wrong), before the op runs. An ``attn_bias`` that requires grad
    gets its gradient (the backward's dS, float32, summed over the dimensions the bias
    broadcasts along, in the bias's dtype).

    ``dropout_p > 0`` runs ``fwd_dropout`` (attention dropout on P, torch's semantics, from
    torch's default CUDA generator; its ``rng_state`` output is kept for the backward and not
    returned); while a graph is traced (:func:`graph_tracing`), ``fwd_dropout_seeded`` on an
    ``rng_state`` that the graph draws with ``torch.randint`` (a random op the compiler knows: two calls never merge,
    a recomputed forward reuses the saved draw, ``torch.manual_seed`` reproduces a compiled
    run; the masks differ from an eager run's under the same seed). Returns ``(out,
    softmax_lse)`` either way.
    """
    if dropout_p:
        if not DROPOUT_AVAILABLE:
            require_extension()
            raise RuntimeError("flash_attention_sm75: the compiled extension has no dropout op "
                               "(torch.ops.flash_attention_sm75.fwd_dropout): it was built from "
                               "older sources; " + BUILD_HINT)
        rest = (softmax_scale, is_causal, causal_bottom_right, leftpad_k, seqused_k,
                window_size_left, window_size_right, softcap, alibi_slopes)
        if graph_tracing():
            # fwd_dropout draws from torch's generator inside itself, which a compiled graph
            # cannot see (it would merge two such calls, or recompute one with another seed):
            # the graph draws the [seed, offset] pair with torch.randint instead, a random op
            # the compiler keeps, saves rather than recomputes, and seeds from torch's
            # generator (torch.manual_seed reproduces a compiled run), and the kernel reads it.
            if not SEEDED_DROPOUT_AVAILABLE:
                raise RuntimeError("flash_attention_sm75: dropout under torch.compile needs "
                                   "the op fwd_dropout_seeded, which the compiled extension "
                                   "lacks (built from older sources); " + BUILD_HINT)
            rng_state = torch.randint(0, 2 ** 62, (2,), dtype=torch.int64, device=q.device)
            return _call("fwd_dropout_seeded", (q, k, v, float(dropout_p), rng_state) + rest,
                         deterministic, attn_bias, bhsd_inputs)
        return _call("fwd_dropout", (q, k, v, float(dropout_p)) + rest, deterministic,
                     attn_bias, bhsd_inputs)[:2]
    return _call("fwd", (q, k, v, softmax_scale, is_causal, causal_bottom_right, leftpad_k,
                         seqused_k, window_size_left, window_size_right, softcap, alibi_slopes),
                 deterministic, attn_bias, bhsd_inputs)


def call_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale=None, is_causal=False, seqused_k=None, window_size_left=-1,
                    window_size_right=-1, softcap=0.0, alibi_slopes=None, *,
                    deterministic: bool = False, dropout_p: float = 0.0):
    """``torch.ops.flash_attention_sm75.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k, softmax_scale, is_causal, seqused_k, window_size_left,
    window_size_right, softcap, alibi_slopes)`` (packed sequences, flash-attn's varlen layout:
    q ``(total_q, h, d)``, k/v ``(total_k, h_k, d)``; returns out ``(total_q, h, d)`` and the
    float32 LSE ``(h, total_q)``), exactly as :func:`call_fwd` calls ``fwd``: below autograd
    when no gradient can flow, through the twin ``varlen_fwd_deterministic_bwd`` when
    ``deterministic=True`` and autograd records the call, and the same errors before the op
    runs (forward-mode AD, torch.func reverse-mode transforms, slopes that require grad).

    ``dropout_p > 0`` runs ``varlen_fwd_dropout`` on an ``rng_state`` drawn here with
    ``torch.randint`` on q's device, in every mode: from torch's generator (``torch.manual_seed``
    reproduces a run), a new draw at each replay of a captured CUDA graph, and a random op that
    a compiled graph keeps per call (as :func:`call_fwd` does while tracing). Sequence ``b``'s
    mask is the kernels' slices ``b * num_heads + head`` at its own query / key positions.

    The op does not read ``cu_seqlens_*`` against ``max_seqlen_*`` (a longer sequence is
    undefined behaviour): callers check them first (``_packing.check_cu_seqlens``)."""
    require_varlen()
    rest = (softmax_scale, is_causal, seqused_k, window_size_left, window_size_right, softcap,
            alibi_slopes)
    meta = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if dropout_p:
        if not VARLEN_DROPOUT_AVAILABLE:
            raise RuntimeError("flash_attention_sm75: the compiled extension has no packed "
                               "dropout op (torch.ops.flash_attention_sm75.varlen_fwd_dropout): "
                               "it was built from older sources; " + BUILD_HINT)
        rng_state = torch.randint(0, 2 ** 62, (2,), dtype=torch.int64, device=q.device)
        return _call("varlen_fwd_dropout", meta + (float(dropout_p), rng_state) + rest,
                     deterministic)
    return _call("varlen_fwd", meta + rest, deterministic)


def call_kvcache_fwd(q, k_cache, v_cache, cache_seqlens, k=None, v=None, cache_leftpad=None,
                     block_table=None, softmax_scale=None, is_causal=False, window_size_left=-1,
                     window_size_right=-1, softcap=0.0, alibi_slopes=None):
    """``torch.ops.flash_attention_sm75.kvcache_fwd(...)``: ``k`` / ``v`` appended into
    ``k_cache`` / ``v_cache`` in place at rows ``cache_seqlens[b] + i`` (a mutation the op's
    schema declares), then each sequence's queries attend to its cache rows ``[cache_leftpad[b],
    cache_seqlens[b] + seqlen_new)``, bottom-right aligned per sequence; plain caches
    ``(batch_cache >= batch, seqlen_cache, h_k, d)`` or pages through ``block_table`` (page
    size a multiple of ``PAGE_BLOCK_MULTIPLE``, or a one-column table). Returns ``(out (b,
    seqlen_q, h, d), softmax_lse (b, h, seqlen_q) float32)``. No autograd (flash-attn's
    kvcache has none): callers refuse inputs that require grad. The index values are checked
    by the op before any write: ``ValueError`` on the CPU, a device-side assertion on CUDA
    (reading them on the host would cost a synchronisation per call)."""
    require_kvcache()
    if torch.is_grad_enabled():
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise ValueError(f"flash_attention_sm75: {name} requires grad: the KV-cache op "
                                 f"writes it in place and has no backward; call it under "
                                 f"torch.no_grad()")
    if isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.numel():
        from . import _packing

        _packing.check_on_device(torch.isfinite(alibi_slopes).all(),
                                 "flash_attention_sm75: alibi_slopes must be finite, got a NaN "
                                 "or infinite slope")
    args = (q, k_cache, v_cache, cache_seqlens, k, v, cache_leftpad, block_table, softmax_scale,
            is_causal, window_size_left, window_size_right, softcap, alibi_slopes)
    if torch.compiler.is_compiling():  # the graph gets the plain op
        return torch.ops.flash_attention_sm75.kvcache_fwd(*args)
    # Below autograd: the op has no autograd kernel, and nothing can need one (the callers
    # refuse inputs that require grad); this skips the fallthrough's cost.
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.flash_attention_sm75.kvcache_fwd(*args)


def _call(name: str, args: tuple, deterministic: bool, attn_bias=None,
          bhsd_inputs: bool = False):
    """``torch.ops.flash_attention_sm75.<name>(*args)`` (``fwd`` or ``varlen_fwd``; q, k, v
    first, the slopes last; ``attn_bias``, ``fwd`` only, as a keyword when given) as
    :func:`call_fwd` describes: the checks first, then through the autograd kernel (the twin
    ``<name>_deterministic_bwd`` for ``deterministic``), through the same formula as an eager
    ``autograd.Function`` (:func:`_eager_function`), or below autograd. ``bhsd_inputs``: q, k,
    v are BHSD (:func:`call_fwd`). The op is looked up per call: tests spy on the attribute."""
    q, k, v, alibi_slopes = args[0], args[1], args[2], args[-1]
    kw = {} if attn_bias is None else {"attn_bias": attn_bias}
    if isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.numel():
        # A NaN or infinite slope would give NaN outputs; its values live on the device, so
        # the check is a device-side assertion there (ValueError on the CPU), never silent.
        from . import _packing

        _packing.check_on_device(torch.isfinite(alibi_slopes).all(),
                                 "flash_attention_sm75: alibi_slopes must be finite, got a NaN "
                                 "or infinite slope")
    ns = torch.ops.flash_attention_sm75
    path = _autograd_path(q, k, v, alibi_slopes, attn_bias)
    if path == _EAGER:
        return _EAGER_FUNCTIONS[name, deterministic, bhsd_inputs].apply(
            *(args if attn_bias is None else args + (attn_bias,)))
    if bhsd_inputs:
        args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)) + args[3:]
    if path == _OP:
        return getattr(ns, name + "_deterministic_bwd" if deterministic else name)(*args, **kw)
    # No gradient can flow, so there is no backward for `deterministic` to reach.
    with torch._C._AutoDispatchBelowAutograd():
        return getattr(ns, name)(*args, **kw)


def call_fwd_checked(q, k, v, softmax_scale, is_causal, causal_bottom_right, leftpad_k=None,
                     seqused_k=None, window_size_left=-1, window_size_right=-1, softcap=0.0):
    """:func:`call_fwd` without slopes and ``deterministic=False``, for a caller that has
    established in this same call what :func:`_autograd_path` would otherwise test first:
    nothing traces (``torch.compiler.is_compiling()`` and ``torch.jit.is_tracing()`` are
    False), no forward-mode AD level is open and no ``torch.func`` transform is active (the
    transformers integration's per-forward decision, ``_decision_key``). What is left to decide
    per call is what can change between two calls of one forward: a ``__torch_function__``
    mode, or grad mode with an input that requires grad, take the autograd kernel; otherwise
    the op runs below autograd. Results and errors are :func:`call_fwd`'s; ~1 us less host
    time per call."""
    ns = torch.ops.flash_attention_sm75  # looked up per call, as _call does (tests spy on it)
    args = (q, k, v, softmax_scale, is_causal, causal_bottom_right, leftpad_k, seqused_k,
            window_size_left, window_size_right, softcap, None)
    # Inference mode excludes the autograd dispatch keys itself: the guard below would only
    # cost its ~0.5 us (generate() under torch.inference_mode()).
    if torch.is_inference_mode_enabled() or torch._C._is_torch_function_mode_enabled():
        return ns.fwd(*args)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        if _dispatch_mode_tracing():
            return ns.fwd(*args)
        return _EAGER_FUNCTIONS["fwd", False, False].apply(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return ns.fwd(*args)


_OP = "op"
_EAGER = "eager"


def _autograd_path(q, k, v, alibi_slopes, attn_bias=None) -> Optional[str]:
    """The checks of :func:`call_fwd` / :func:`call_varlen_fwd` before the op (they raise), then
    how the op must be called (see :func:`call_fwd`): ``_OP`` through its autograd kernel (a
    graph is traced, a ``torch.func`` transform or a ``__torch_function__`` mode is active),
    ``_EAGER`` through the same formula as an eager ``autograd.Function`` (a gradient can flow,
    nothing traces), or None below autograd (no gradient can flow)."""
    name = forward_ad_input(q, k, v, attn_bias)
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
    if (alibi_slopes is not None and alibi_slopes.requires_grad and torch.is_grad_enabled()):
        raise ValueError("flash_attention_sm75: " + _SLOPES_GRAD)
    if (torch.compiler.is_compiling() or transforms
            or torch._C._is_torch_function_mode_enabled()):
        return _OP
    if (torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad
                 or (attn_bias is not None and attn_bias.requires_grad))):
        return _OP if _dispatch_mode_tracing() or torch._C._is_tracing() else _EAGER
    return None


_TRACING_MODE_KEYS = tuple(getattr(torch._C._TorchDispatchModeKey, name)
                           for name in ("PROXY", "FAKE", "FUNCTIONAL")
                           if hasattr(torch._C._TorchDispatchModeKey, name))


def _dispatch_mode_tracing() -> bool:
    """A proxy, fake or functional dispatch mode is active (``make_fx``, AOTAutograd without
    dynamo, FakeTensorMode): such tracers get the op with its registered autograd formula (as
    ``torch.jit.trace`` does, tested beside this), never the eager autograd function."""
    get = torch._C._get_dispatch_mode
    for key in _TRACING_MODE_KEYS:
        if get(key) is not None:
            return True
    return False


def _check_one_device(q, **others) -> None:
    for name, t in others.items():
        if t is not None:
            torch._check_value(t.device == q.device,
                               lambda: f"flash_attention_sm75: {name} must be on the same device "
                                       f"as q ({q.device}), got {t.device}")


def _fwd_fake(q, k, v, softmax_scale=None, is_causal=False, causal_bottom_right=True,
              leftpad_k=None, seqused_k=None, window_size_left=-1, window_size_right=-1,
              softcap=0.0, alibi_slopes=None, attn_bias=None):
    # Shapes only (the rulebook validated the call): what the output shapes are derived from.
    # And one device: a meta tensor among real ones dispatches here, and the outputs would be
    # uninitialised memory on q's device.
    _check_one_device(q, k=k, v=v, leftpad_k=leftpad_k, seqused_k=seqused_k,
                      alibi_slopes=alibi_slopes, attn_bias=attn_bias)
    torch._check(q.dim() == 4 and k.dim() == 4,
                 lambda: "flash_attention_sm75: q, k and v must be 4-D")
    torch._check(k.shape == v.shape, lambda: "flash_attention_sm75: k and v must have one shape")
    torch._check(k.shape[0] == q.shape[0] and k.shape[3] == q.shape[3],
                 lambda: "flash_attention_sm75: q and k must share batch size and head_dim")
    b, seqlen_q, h, d = q.shape
    # The C++: at::empty({b, sq, h, d}, q.options()) and a float32 (b, h, sq).
    return q.new_empty((b, seqlen_q, h, d)), q.new_empty((b, h, seqlen_q), dtype=torch.float32)


def _fwd_dropout_fake(q, k, v, dropout_p, softmax_scale=None, is_causal=False,
                      causal_bottom_right=True, leftpad_k=None, seqused_k=None,
                      window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                      attn_bias=None):
    out, lse = _fwd_fake(q, k, v, softmax_scale, is_causal, causal_bottom_right, leftpad_k,
                         seqused_k, window_size_left, window_size_right, softcap, alibi_slopes,
                         attn_bias)
    # The C++: at::zeros({2}, q.options().dtype(at::kLong)) (then written by the kernel).
    return out, lse, q.new_empty((2,), dtype=torch.int64)


def _check_rng_state_fake(rng_state, q) -> None:
    # The C++ check_rng_state's conditions (a fake tensor on another device would otherwise
    # trace a graph the op then refuses).
    torch._check(rng_state.dtype == torch.int64 and rng_state.shape == (2,),
                 lambda: "flash_attention_sm75: rng_state must be an int64 tensor of 2 elements")
    torch._check(rng_state.device == q.device or rng_state.device.type == "cpu",
                 lambda: f"flash_attention_sm75: rng_state must be on q's device ({q.device}) or "
                         f"the CPU, got {rng_state.device}")


def _fwd_dropout_seeded_fake(q, k, v, dropout_p, rng_state, softmax_scale=None,
                             is_causal=False, causal_bottom_right=True, leftpad_k=None,
                             seqused_k=None, window_size_left=-1, window_size_right=-1,
                             softcap=0.0, alibi_slopes=None, attn_bias=None):
    _check_rng_state_fake(rng_state, q)
    return _fwd_fake(q, k, v, softmax_scale, is_causal, causal_bottom_right, leftpad_k,
                     seqused_k, window_size_left, window_size_right, softcap, alibi_slopes,
                     attn_bias)


def _dropout_mask_fake(rng_state, batch, heads, seqlen_q, seqlen_k, dropout_p):
    return torch.empty((batch, heads, seqlen_q, seqlen_k), dtype=torch.bool, device="cpu")


def _bwd_fake(dout, q, k, v, out, softmax_lse, softmax_scale, is_causal, causal_bottom_right,
              leftpad_k=None, seqused_k=None, deterministic=False, grad_softmax_lse=None,
              window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
              attn_bias=None, dropout_p=0.0, rng_state=None):
    _check_one_device(q, dout=dout, k=k, v=v, out=out, softmax_lse=softmax_lse,
                      leftpad_k=leftpad_k, seqused_k=seqused_k, grad_softmax_lse=grad_softmax_lse,
                      alibi_slopes=alibi_slopes, attn_bias=attn_bias)
    torch._check(dout.shape == q.shape, lambda: "flash_attention_sm75: dout must have the shape of q")
    torch._check(out.shape == q.shape, lambda: "flash_attention_sm75: out must have the shape of q")
    # The C++: at::empty({b, sq, h, d}, q.options()) and at::empty({b, sk, h_k, d}, ...) twice.
    return q.new_empty(q.shape), k.new_empty(k.shape), k.new_empty(k.shape)


def _bwd_dbias_fake(dout, q, k, v, out, softmax_lse, *args, **kwargs):
    dq, dk, dv = _bwd_fake(dout, q, k, v, out, softmax_lse, *args, **kwargs)
    # The C++: at::zeros({b, h, sq, sk}, float32) on q's device.
    b, s_q, h = q.shape[:3]
    return dq, dk, dv, q.new_empty((b, h, s_q, k.shape[1]), dtype=torch.float32)


def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale=None, is_causal=False, seqused_k=None, window_size_left=-1,
                     window_size_right=-1, softcap=0.0, alibi_slopes=None):
    # As _fwd_fake, for flash-attn's packed layout.
    _check_one_device(q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      seqused_k=seqused_k, alibi_slopes=alibi_slopes)
    torch._check(q.dim() == 3 and k.dim() == 3,
                 lambda: "flash_attention_sm75: q, k and v must be 3-D (total, heads, head_dim)")
    torch._check(k.shape == v.shape, lambda: "flash_attention_sm75: k and v must have one shape")
    torch._check(k.shape[2] == q.shape[2],
                 lambda: "flash_attention_sm75: q and k must share head_dim")
    torch._check(cu_seqlens_q.dim() == 1 and cu_seqlens_q.shape == cu_seqlens_k.shape,
                 lambda: "flash_attention_sm75: cu_seqlens_q and cu_seqlens_k must be 1-D, of "
                         "one length (batch + 1)")
    total_q, h, d = q.shape
    # The C++: at::empty({total_q, h, d}, q.options()) and a float32 (h, total_q).
    return q.new_empty((total_q, h, d)), q.new_empty((h, total_q), dtype=torch.float32)


def _varlen_fwd_dropout_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             dropout_p, rng_state, softmax_scale=None, is_causal=False,
                             seqused_k=None, window_size_left=-1, window_size_right=-1,
                             softcap=0.0, alibi_slopes=None):
    _check_rng_state_fake(rng_state, q)
    return _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            softmax_scale, is_causal, seqused_k, window_size_left,
                            window_size_right, softcap, alibi_slopes)


def _varlen_bwd_fake(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, softmax_scale, is_causal, seqused_k=None, deterministic=False,
                     grad_softmax_lse=None, window_size_left=-1, window_size_right=-1,
                     softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None):
    _check_one_device(q, dout=dout, k=k, v=v, out=out, softmax_lse=softmax_lse,
                      cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
                      grad_softmax_lse=grad_softmax_lse, alibi_slopes=alibi_slopes)
    torch._check(dout.shape == q.shape, lambda: "flash_attention_sm75: dout must have the shape of q")
    torch._check(out.shape == q.shape, lambda: "flash_attention_sm75: out must have the shape of q")
    # The C++: at::empty({total_q, h, d}, q.options()) and at::empty({total_k, h_k, d}, ...) twice.
    return q.new_empty(q.shape), k.new_empty(k.shape), k.new_empty(k.shape)


def _kvcache_fwd_fake(q, k_cache, v_cache, cache_seqlens, k=None, v=None, cache_leftpad=None,
                      block_table=None, softmax_scale=None, is_causal=False, window_size_left=-1,
                      window_size_right=-1, softcap=0.0, alibi_slopes=None):
    _check_one_device(q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, k=k, v=v,
                      cache_leftpad=cache_leftpad, block_table=block_table,
                      alibi_slopes=alibi_slopes)
    torch._check(q.dim() == 4 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape,
                 lambda: "flash_attention_sm75: q, k_cache and v_cache must be 4-D, the caches "
                         "of one shape")
    b, seqlen_q, h, d = q.shape
    # The C++: at::empty({b, sq, h, d}, q.options()) and a float32 (b, h, sq); the caches are
    # written in place (the schema's Tensor(a!) / Tensor(b!)).
    return q.new_empty((b, seqlen_q, h, d)), q.new_empty((b, h, seqlen_q), dtype=torch.float32)


def _fwd_setup_context(ctx, inputs, output, deterministic=False, extra=()):
    (q, k, v, softmax_scale, is_causal, causal_bottom_right, leftpad_k, seqused_k,
     window_size_left, window_size_right, softcap, alibi_slopes) = inputs[:12]
    attn_bias = inputs[12] if len(inputs) > 12 else None
    # True for the twin op fwd_deterministic_bwd: the forward's request, kept for the backward.
    ctx.deterministic = deterministic
    out, softmax_lse = output
    ctx.save_for_backward(q, k, v, out, softmax_lse, leftpad_k, seqused_k, alibi_slopes,
                          attn_bias, *extra)
    ctx.n_inputs = len(inputs)
    ctx.dropout_p = 0.0  # fwd_dropout's setup sets its own
    ctx.shift = 0  # inputs between v and softmax_scale (fwd_dropout: 1, fwd_dropout_seeded: 2)
    ctx.softcap = float(softcap)
    ctx.softmax_scale = (1.0 / math.sqrt(q.shape[-1])) if softmax_scale is None else float(softmax_scale)
    ctx.is_causal = bool(is_causal)
    ctx.causal_bottom_right = bool(causal_bottom_right)
    ctx.window_size = (int(window_size_left), int(window_size_right))
    # Unused outputs (usually softmax_lse) get None instead of a materialized zero tensor.
    ctx.set_materialize_grads(False)


def _fwd_backward(ctx, grad_out, grad_lse, grad_rng_state=None):
    """The backward of ``fwd``, ``fwd_dropout`` and ``fwd_dropout_seeded`` (whose inputs have
    ``dropout_p`` / ``dropout_p, rng_state`` after v and whose saved tensors end with the
    ``rng_state`` the forward drew from)."""
    saved = ctx.saved_tensors
    q, k, v, out, softmax_lse, leftpad_k, seqused_k, alibi_slopes, attn_bias = saved[:9]
    # The eager functions of the BHSD doors save q, k, v BHSD (_eager_function).
    bhsd = getattr(ctx, "bhsd_inputs", False)
    if bhsd:
        q, k, v = _bshd(q), _bshd(k), _bshd(v)
    # softmax_scale, is_causal, causal_bottom_right, leftpad_k, seqused_k, window_size_left,
    # window_size_right, softcap, alibi_slopes (and attn_bias; the dropout ops: dropout_p (and
    # rng_state) first)
    rest = [None] * (ctx.n_inputs - 3)
    shift = ctx.shift
    bias_at = 12 + shift
    if len(ctx.needs_input_grad) > 11 + shift and ctx.needs_input_grad[11 + shift]:
        # The doors refuse slopes that require grad (call_fwd); the raw op must not return a
        # silent zero either.
        raise NotImplementedError(
            "flash_attention_sm75: no gradient for alibi_slopes; pass alibi_slopes.detach()")
    want_dbias = len(ctx.needs_input_grad) > bias_at and ctx.needs_input_grad[bias_at]
    if grad_out is None and grad_lse is None:
        return (None, None, None) + tuple(rest)
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    kw = {} if attn_bias is None else {"attn_bias": attn_bias}
    if ctx.dropout_p:
        kw.update(dropout_p=ctx.dropout_p, rng_state=saved[9])
    # bwd_dbias also returns dS for every (batch, head, query, key) (0 where a row sees no key);
    # the bias's gradient sums it over the dimensions the bias broadcasts along.
    if want_dbias and not DBIAS_AVAILABLE:
        raise RuntimeError("flash_attention_sm75: the compiled extension has no bias gradient "
                           "(torch.ops.flash_attention_sm75.bwd_dbias): it was built from older "
                           "sources; " + BUILD_HINT)
    grads = _call_bwd("bwd_dbias" if want_dbias else "bwd",
                      grad_out, q, k, v, out, softmax_lse, ctx.softmax_scale, ctx.is_causal,
                      ctx.causal_bottom_right, leftpad_k, seqused_k,
                      ctx.deterministic or _deterministic_forced(), grad_lse, *ctx.window_size,
                      ctx.softcap, alibi_slopes, **kw)
    if want_dbias:
        rest[bias_at - 3] = reduce_dbias(grads[3], attn_bias)
    if bhsd:
        return (_bshd(grads[0]), _bshd(grads[1]), _bshd(grads[2])) + tuple(rest)
    return tuple(grads[:3]) + tuple(rest)


def _call_bwd(name: str, *args, **kw):
    """``torch.ops.flash_attention_sm75.<name>`` (a backward op) from an autograd formula: below
    autograd unless grad mode is on (``create_graph=True``, where the op's own formula refuses a
    double backward); the same call as through the op's Python autograd kernel, without it."""
    op = getattr(torch.ops.flash_attention_sm75, name)  # per call: tests spy on it
    if torch.is_grad_enabled():
        return op(*args, **kw)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args, **kw)


def reduce_dbias(dbias: torch.Tensor, attn_bias: torch.Tensor) -> torch.Tensor:
    """The gradient of ``attn_bias`` from the kernel's (batch, heads, seqlen_q, seqlen_k) float32
    dS: summed over the dimensions the bias broadcasts along (its size-1 and missing leading
    ones; a stride-0 expanded bias has its full shape, and autograd's expand sums the rest), in
    the bias's dtype."""
    return dbias.sum_to_size(attn_bias.shape).to(attn_bias.dtype)


def _fwd_det_setup_context(ctx, inputs, output):
    _fwd_setup_context(ctx, inputs, output, deterministic=True)


def _fwd_dropout_setup_context(ctx, inputs, output, deterministic=False):
    # fwd's inputs without dropout_p (inputs[3]); rng_state (output[2]) kept for the backward.
    _fwd_setup_context(ctx, inputs[:3] + inputs[4:], output[:2], deterministic,
                       extra=(output[2],))
    ctx.n_inputs = len(inputs)
    ctx.dropout_p = float(inputs[3])
    ctx.shift = 1


def _fwd_dropout_det_setup_context(ctx, inputs, output):
    _fwd_dropout_setup_context(ctx, inputs, output, deterministic=True)


def _fwd_dropout_seeded_setup_context(ctx, inputs, output, deterministic=False):
    # fwd's inputs without dropout_p, rng_state (inputs[3:5]); the given rng_state kept.
    _fwd_setup_context(ctx, inputs[:3] + inputs[5:], output, deterministic,
                       extra=(inputs[4],))
    ctx.n_inputs = len(inputs)
    ctx.dropout_p = float(inputs[3])
    ctx.shift = 2


def _fwd_dropout_seeded_det_setup_context(ctx, inputs, output):
    _fwd_dropout_seeded_setup_context(ctx, inputs, output, deterministic=True)


def _varlen_fwd_setup_context(ctx, inputs, output, deterministic=False, extra=()):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, is_causal,
     seqused_k, window_size_left, window_size_right, softcap, alibi_slopes) = inputs
    ctx.deterministic = deterministic  # as _fwd_setup_context
    out, softmax_lse = output
    ctx.save_for_backward(q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                          alibi_slopes, *extra)
    ctx.n_inputs = len(inputs)
    ctx.dropout_p = 0.0  # varlen_fwd_dropout's setup sets its own
    ctx.shift = 0  # inputs between max_seqlen_k and softmax_scale (varlen_fwd_dropout: 2)
    # As they came: under torch.compile with dynamic shapes they are symbolic, and int() would
    # specialise the graph to their values (one recompilation per packed batch's max length).
    ctx.max_seqlen = tuple(n if isinstance(n, torch.SymInt) else int(n)
                           for n in (max_seqlen_q, max_seqlen_k))
    ctx.softcap = float(softcap)
    ctx.softmax_scale = (1.0 / math.sqrt(q.shape[-1])) if softmax_scale is None else float(softmax_scale)
    ctx.is_causal = bool(is_causal)
    ctx.window_size = (int(window_size_left), int(window_size_right))
    ctx.set_materialize_grads(False)


def _varlen_fwd_backward(ctx, grad_out, grad_lse):
    """The backward of ``varlen_fwd`` and ``varlen_fwd_dropout`` (whose inputs have
    ``dropout_p, rng_state`` after max_seqlen_k and whose saved tensors end with that
    ``rng_state``)."""
    saved = ctx.saved_tensors
    q, k, v, out, softmax_lse, cu_q, cu_k, seqused_k, alibi_slopes = saved[:9]
    # cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, (dropout_p, rng_state,)
    # softmax_scale, is_causal, seqused_k, window_size_left, window_size_right, softcap,
    # alibi_slopes
    none = (None,) * (ctx.n_inputs - 3)
    slopes_at = 13 + ctx.shift
    if len(ctx.needs_input_grad) > slopes_at and ctx.needs_input_grad[slopes_at]:
        raise NotImplementedError(
            "flash_attention_sm75: no gradient for alibi_slopes; pass alibi_slopes.detach()")
    if grad_out is None and grad_lse is None:
        return (None, None, None) + none
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    kw = dict(dropout_p=ctx.dropout_p, rng_state=saved[9]) if ctx.dropout_p else {}
    dq, dk, dv = _call_bwd(
        "varlen_bwd", grad_out, q, k, v, out, softmax_lse, cu_q, cu_k, *ctx.max_seqlen,
        ctx.softmax_scale, ctx.is_causal, seqused_k, ctx.deterministic or _deterministic_forced(),
        grad_lse, *ctx.window_size, ctx.softcap, alibi_slopes, **kw)
    return (dq, dk, dv) + none


def _varlen_fwd_det_setup_context(ctx, inputs, output):
    _varlen_fwd_setup_context(ctx, inputs, output, deterministic=True)


def _varlen_fwd_dropout_setup_context(ctx, inputs, output, deterministic=False):
    # varlen_fwd's inputs without dropout_p, rng_state (inputs[7:9]); the rng_state kept.
    _varlen_fwd_setup_context(ctx, inputs[:7] + inputs[9:], output, deterministic,
                              extra=(inputs[8],))
    ctx.n_inputs = len(inputs)
    ctx.dropout_p = float(inputs[7])
    ctx.shift = 2


def _varlen_fwd_dropout_det_setup_context(ctx, inputs, output):
    _varlen_fwd_dropout_setup_context(ctx, inputs, output, deterministic=True)


def _define_deterministic_twin(base: str) -> None:
    """Define ``flash_attention_sm75::<base>_deterministic_bwd``: the schema of ``<base>``
    (``fwd``, ``fwd_dropout``, ``varlen_fwd``, ...) under another name (read from the registered op, so the twin
    follows any change of it), computing with ``<base>`` itself; only its autograd formula
    differs (see :func:`call_fwd`). A CompositeExplicitAutograd kernel serves every backend that
    ``<base>`` has and keeps the twin one node in traced graphs (inductor calls it at run
    time)."""
    op = getattr(torch.ops.flash_attention_sm75, base)
    schema = str(op.default._schema)
    name = op.default._schema.name  # "flash_attention_sm75::<base>"
    assert schema.startswith(name + "("), schema
    twin = base + "_deterministic_bwd"
    lib = torch.library.Library("flash_attention_sm75", "FRAGMENT")
    lib.define(twin + schema[len(name):])

    def impl(*args):
        # Below autograd here (the twin's own formula runs above): the plain op computes
        # (looked up per call, as the doors do).
        return getattr(torch.ops.flash_attention_sm75, base)(*args)

    lib.impl(twin, impl, "CompositeExplicitAutograd")
    _libraries.append(lib)  # a Library's registrations live as long as the object


def _bwd_setup_context(ctx, inputs, output):
    pass


def _bwd_backward(ctx, *grads):
    # Without an autograd formula for bwd, torch would let a second backward run and return
    # missing gradients with only a warning; fail loudly instead.
    raise NotImplementedError(
        "flash_attention_sm75: double backward (gradients of gradients, create_graph=True "
        "through the attention backward) is not implemented")


_libraries = []

_EAGER_FUNCTIONS: dict = {}
"""(op name, deterministic, bhsd_inputs) -> the eager autograd.Function of that op
(:func:`_register_autograd`)."""


def _bshd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


def _eager_function(name: str, setup_context, backward, bhsd_inputs: bool):
    """An ``autograd.Function`` that runs ``torch.ops.flash_attention_sm75.<name>`` below autograd
    and records ``backward`` with the context ``setup_context`` fills: the formula that
    ``torch.library.register_autograd`` registers for the op, without that kernel's per-call
    Python (``fill_defaults`` rebuilds the schema's argument list per argument, and
    ``op.redispatch``). The doors use it when a gradient can flow and nothing traces
    (``_autograd_path``); graphs, ``torch.func`` transforms and ``__torch_function__`` modes
    keep the op and its registered kernel. The arguments are the op's, positional, in schema
    order (omitted trailing defaults stay omitted: the setup and the backward read
    ``len(inputs)``). ``bhsd_inputs``: q, k, v come BHSD and go to the op as ``transpose(1,
    2)`` views made here, where autograd records no view node (three fewer nodes in the forward
    and the backward); they are saved as given, and ``_fwd_backward`` (``ctx.bhsd_inputs``)
    transposes them and their gradients. The outputs are the op's either way
    (the BHSD doors transpose ``out`` outside, as a view autograd records, as before). Host
    time of an eager forward + backward: benchmarks/NOTES.md (session 25)."""

    def forward(ctx, *args):
        op_args = args
        if bhsd_inputs:
            op_args = (_bshd(args[0]), _bshd(args[1]), _bshd(args[2])) + args[3:]
        with torch._C._AutoDispatchBelowAutograd():
            output = getattr(torch.ops.flash_attention_sm75, name)(*op_args)
        # The inputs themselves are saved (views made here would turn an in-place change of an
        # input into a misleading error about a no-grad view); the backward transposes them.
        setup_context(ctx, args, output)
        ctx.bhsd_inputs = bhsd_inputs
        return output

    return type(f"FlashAttentionSm75_{name}", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def _register_autograd(name: str, backward, setup_context, det_setup_context,
                       layouts=(False, True)) -> None:
    """The autograd formula of ``<name>`` and of its twin ``<name>_deterministic_bwd`` (whose
    context asks the backward for determinism): registered on the ops (graphs, transforms,
    the raw op) and as the eager functions of :func:`_eager_function` (the doors), for each
    ``bhsd_inputs`` in ``layouts`` (BHSD inputs only where the backward reads
    ``ctx.bhsd_inputs``: ``_fwd_backward``)."""
    for op_name, setup, det in ((name, setup_context, False),
                                (name + "_deterministic_bwd", det_setup_context, True)):
        torch.library.register_autograd("flash_attention_sm75::" + op_name, backward,
                                        setup_context=setup)
        # The twin computes with the base op (_define_deterministic_twin): below autograd the
        # eager function calls the base op itself.
        for bhsd in layouts:
            _EAGER_FUNCTIONS[name, det, bhsd] = _eager_function(name, setup, backward, bhsd)


def _has_op(name: str) -> bool:
    try:
        getattr(torch.ops.flash_attention_sm75, name)
    except (AttributeError, RuntimeError):
        return False
    return True


DROPOUT_AVAILABLE: bool = EXTENSION_AVAILABLE and _has_op("fwd_dropout")
"""Whether the compiled extension has attention dropout (``fwd_dropout``, ``dropout_mask`` and
``bwd``'s ``dropout_p`` / ``rng_state``); False for an extension built from older sources."""

SEEDED_DROPOUT_AVAILABLE: bool = DROPOUT_AVAILABLE and _has_op("fwd_dropout_seeded")
"""Whether the compiled extension has ``fwd_dropout_seeded`` (dropout from a given
``rng_state``: what a torch.compile graph runs); False for an extension built from older
sources (dropout is then refused while compiling)."""

DBIAS_AVAILABLE: bool = EXTENSION_AVAILABLE and _has_op("bwd_dbias")
"""Whether the compiled extension has the bias gradient (``bwd_dbias``); False for an extension
built from older sources."""

VARLEN_AVAILABLE: bool = EXTENSION_AVAILABLE and _has_op("varlen_fwd") and _has_op("varlen_bwd")
"""Whether the compiled extension has the varlen ops (``varlen_fwd`` / ``varlen_bwd``); False for
an extension built from sources older than them (rebuild it)."""


VARLEN_DROPOUT_AVAILABLE: bool = VARLEN_AVAILABLE and _has_op("varlen_fwd_dropout")
"""Whether the compiled extension has dropout for packed sequences (``varlen_fwd_dropout`` and
``varlen_bwd``'s ``dropout_p`` / ``rng_state``); False for an extension built from older
sources."""


def require_varlen() -> None:
    require_extension()
    if not VARLEN_AVAILABLE:
        raise RuntimeError(
            "flash_attention_sm75: the compiled extension has no varlen op "
            "(torch.ops.flash_attention_sm75.varlen_fwd): it was built from older sources; "
            + BUILD_HINT)


KVCACHE_AVAILABLE: bool = EXTENSION_AVAILABLE and _has_op("kvcache_fwd")
"""Whether the compiled extension has the KV-cache op (``kvcache_fwd``); False for an extension
built from sources older than it (the KV-cache door then runs on the varlen / dense ops)."""

PAGE_BLOCK_MULTIPLE = 64
"""Page sizes the paged kernels take: multiples of this (``kPageBlockMultiple`` in
csrc/kernels/flash.h); other sizes are gathered into a contiguous copy first."""


def require_kvcache() -> None:
    require_extension()
    if not KVCACHE_AVAILABLE:
        raise RuntimeError(
            "flash_attention_sm75: the compiled extension has no KV-cache op "
            "(torch.ops.flash_attention_sm75.kvcache_fwd): it was built from older sources; "
            + BUILD_HINT)


if EXTENSION_AVAILABLE:
    _define_deterministic_twin("fwd")
    torch.library.register_fake("flash_attention_sm75::fwd")(_fwd_fake)
    torch.library.register_fake("flash_attention_sm75::fwd_deterministic_bwd")(_fwd_fake)
    torch.library.register_fake("flash_attention_sm75::bwd")(_bwd_fake)
    _register_autograd("fwd", _fwd_backward, _fwd_setup_context, _fwd_det_setup_context)
    torch.library.register_autograd("flash_attention_sm75::bwd", _bwd_backward,
                                    setup_context=_bwd_setup_context)
if DBIAS_AVAILABLE:
    torch.library.register_fake("flash_attention_sm75::bwd_dbias")(_bwd_dbias_fake)
    torch.library.register_autograd("flash_attention_sm75::bwd_dbias", _bwd_backward,
                                    setup_context=_bwd_setup_context)
if DROPOUT_AVAILABLE:
    _define_deterministic_twin("fwd_dropout")
    for _name in ("fwd_dropout", "fwd_dropout_deterministic_bwd"):
        torch.library.register_fake("flash_attention_sm75::" + _name)(_fwd_dropout_fake)
    torch.library.register_fake("flash_attention_sm75::dropout_mask")(_dropout_mask_fake)
    _register_autograd("fwd_dropout", _fwd_backward, _fwd_dropout_setup_context,
                       _fwd_dropout_det_setup_context)
if SEEDED_DROPOUT_AVAILABLE:
    _define_deterministic_twin("fwd_dropout_seeded")
    for _name in ("fwd_dropout_seeded", "fwd_dropout_seeded_deterministic_bwd"):
        torch.library.register_fake("flash_attention_sm75::" + _name)(_fwd_dropout_seeded_fake)
    _register_autograd("fwd_dropout_seeded", _fwd_backward, _fwd_dropout_seeded_setup_context,
                       _fwd_dropout_seeded_det_setup_context)
if VARLEN_AVAILABLE:
    _define_deterministic_twin("varlen_fwd")
    for _name in ("varlen_fwd", "varlen_fwd_deterministic_bwd"):
        torch.library.register_fake("flash_attention_sm75::" + _name)(_varlen_fwd_fake)
    torch.library.register_fake("flash_attention_sm75::varlen_bwd")(_varlen_bwd_fake)
    _register_autograd("varlen_fwd", _varlen_fwd_backward, _varlen_fwd_setup_context,
                       _varlen_fwd_det_setup_context, layouts=(False,))
    torch.library.register_autograd("flash_attention_sm75::varlen_bwd", _bwd_backward,
                                    setup_context=_bwd_setup_context)
if VARLEN_DROPOUT_AVAILABLE:
    _define_deterministic_twin("varlen_fwd_dropout")
    for _name in ("varlen_fwd_dropout", "varlen_fwd_dropout_deterministic_bwd"):
        torch.library.register_fake("flash_attention_sm75::" + _name)(_varlen_fwd_dropout_fake)
    _register_autograd("varlen_fwd_dropout", _varlen_fwd_backward,
                       _varlen_fwd_dropout_setup_context, _varlen_fwd_dropout_det_setup_context,
                       layouts=(False,))
if KVCACHE_AVAILABLE:
    torch.library.register_fake("flash_attention_sm75::kvcache_fwd")(_kvcache_fwd_fake)
