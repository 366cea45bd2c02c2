"""torch's mem-efficient attention as a T4 runs it, as a benchmark backend named "mem_eff_sm75".

On a Turing GPU torch's SDPA mem-efficient backend runs the ``Sm75`` instantiations of its
cutlass kernels (fp16: 64 KiB of shared memory, no cp.async); the H200 we measure on runs their
sm80 instantiations, which no Turing user gets. ``scripts/build_memeff_sm75.py`` builds torch's
own kernels instantiated for ``cutlass::arch::Sm75`` from the headers the torch wheel ships
(``benchmarks/baselines/memeff_sm75.cu`` is our wrapper: kernel choice, parameters, launch as
torch's ``_efficient_attention_forward`` / ``_backward`` do them on a T4) for compute_75 PTX, so
the H200 runs exactly what a T4 runs, through the same PTX JIT as our kernels. It is measured
beside the native ``efficient`` backend, never in its place.

The build lives in the git-ignored ``.peer/memeff_sm75`` (or ``$FLASH_SM75_MEMEFF_SM75_DIR``),
which a GPU run carries along: ``memeff_sm75.so`` (torch ops ``torch.ops.memeff_sm75.fwd`` /
``bwd`` on BSHD fp16, loaded with ``torch.ops.load_library``, so any CPython with the torch it
was built against loads it) and ``BASELINE_INFO.json`` (torch version, cutlass commit, the
kernels per head dim), which the benchmarks record with their numbers.

Layout: the benchmarks hand BHSD views; like ``benchmarks/_peer.py`` the adapter passes the
kernel their BSHD views (``transpose(1, 2)``). Unlike the ssiu peer it copies nothing: torch's
kernels take any strides with a contiguous last dim, and SDPA's mem-efficient backend passes the
same transposed views, so both baselines read the same memory (dO goes through a contiguous copy
inside ``bwd``, as in torch).

Before the backend is timed on a case, :func:`check_against_sdpa` compares its output (and, with
an output gradient, dQ/dK/dV) with torch SDPA's on the same inputs; the sweeps drop it from the
run, with the reason, if it disagrees or raises: a broken baseline never produces numbers.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

import torch

from _peer import read_build_info

ROOT = Path(__file__).resolve().parents[1]
ENV_DIR = "FLASH_SM75_MEMEFF_SM75_DIR"
DEFAULT_DIR = ROOT / ".peer" / "memeff_sm75"
INFO_FILE = "BASELINE_INFO.json"
LIBRARY = "memeff_sm75.so"
NAME = "mem_eff_sm75"
KIND = "baseline"  # in the sweeps' "unavailable" reasons
OPS_NAMESPACE = "memeff_sm75"
# The check before timing: max |x - ref| <= ATOL + RTOL * max |ref| (fp16 kernels, fp32
# accumulation on both sides; a wrong stride, mask or LSE gives errors of the order of the values).
FWD_TOL = (2e-2, 2e-2)
BWD_TOL = (5e-2, 5e-2)


def build_dir() -> Path:
    """Where the build lives: ``$FLASH_SM75_MEMEFF_SM75_DIR`` or ``.peer/memeff_sm75``."""
    return Path(os.environ.get(ENV_DIR) or DEFAULT_DIR)


def build_found() -> bool:
    """Whether a build (its info file) is in :func:`build_dir`."""
    return (build_dir() / INFO_FILE).is_file()


def _ops_registered() -> bool:
    try:
        getattr(torch.ops, OPS_NAMESPACE).fwd  # noqa: B018 (raises when not registered)
        return True
    except (AttributeError, RuntimeError):
        return False


class MemEffSm75:
    """The loaded baseline: ``error`` says why it is unavailable, ``info`` what was built."""

    def __init__(self) -> None:
        self.ops = None
        d = build_dir()
        self.info, self.error = read_build_info(d, INFO_FILE, "scripts/build_memeff_sm75.py",
                                                ENV_DIR)
        if self.error is not None:
            return
        lib = (d / self.info.get("library", LIBRARY)).resolve()
        global _LOADED_FROM
        if _LOADED_FROM is not None and _LOADED_FROM != lib:
            # torch registers a namespace once per process: a second build cannot load
            self.error = f"{_LOADED_FROM} is loaded in this process already, not {lib}"
            return
        try:
            if _LOADED_FROM is None:
                if _ops_registered():
                    raise RuntimeError(f"torch.ops.{OPS_NAMESPACE} is registered by another "
                                       f"library already")
                torch.ops.load_library(str(lib))
                _LOADED_FROM = lib
            self.ops = getattr(torch.ops, OPS_NAMESPACE)
        except Exception as e:  # a build for another torch, a missing library
            self.error = f"loading {lib} failed: {type(e).__name__}: {str(e).strip()[:300]}"

    @property
    def available(self) -> bool:
        return self.ops is not None

    def impl_note(self) -> str:
        """The sweeps' note on its records."""
        return f"cutlass {self.info.get('cutlass_commit')}"

    def describe(self) -> str:
        """One line for the report's header."""
        if self.error:
            return f"UNAVAILABLE: {self.error}"
        i = self.info
        return (f"torch's mem-efficient Sm75 kernels (cutlass {i.get('cutlass_version')} "
                f"{i.get('cutlass_commit')}, built with torch {i.get('torch')}, "
                f"{i.get('arch_list')})")

    def bhsd(self, q, k, v, causal=False):
        """Forward on BHSD views; the output as a BHSD view. The LSE is written only when a
        gradient could be asked for, as SDPA's forward decides (compute_log_sumexp)."""
        lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        out = self.ops.fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           bool(causal), None, lse)[0]
        return out.transpose(1, 2)

    def autograd_bhsd(self) -> Callable:
        """fn(q, k, v, causal) with the baseline's backward behind torch.autograd (BHSD views),
        as the backward benchmark times every backend (the forward keeps its LSE for it)."""
        ops = self.ops

        class _Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, causal):
                qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
                out, lse = ops.fwd(qs, ks, vs, bool(causal), None, True)
                ctx.save_for_backward(qs, ks, vs, out, lse)
                ctx.causal = bool(causal)
                return out.transpose(1, 2)

            @staticmethod
            def backward(ctx, dout):
                qs, ks, vs, out, lse = ctx.saved_tensors
                dq, dk, dv = ops.bwd(dout.transpose(1, 2), qs, ks, vs, out, lse, ctx.causal,
                                     None)
                return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None

        return lambda q, k, v, causal=False: _Fn.apply(q, k, v, causal)


def _mismatch(what: str, x: torch.Tensor, ref: torch.Tensor, tol) -> Optional[str]:
    x, ref = x.detach().float(), ref.detach().float()
    if x.shape != ref.shape:
        return f"{what}: shape {tuple(x.shape)}, SDPA's {tuple(ref.shape)}"
    if not torch.isfinite(x).all():
        return f"{what}: non-finite values"
    diff = float((x - ref).abs().max()) if x.numel() else 0.0
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    bound = tol[0] + tol[1] * scale
    if diff > bound:
        return f"{what}: max |diff| {diff:.3g} vs SDPA > {bound:.3g} (max |SDPA| {scale:.3g})"
    return None


def sdpa_reference_backend(device: str):
    """The SDPA backend the check compares with: mem-efficient on CUDA (O(N) memory at every
    benchmark size), math elsewhere."""
    from torch.nn.attention import SDPBackend

    return SDPBackend.EFFICIENT_ATTENTION if device == "cuda" else SDPBackend.MATH


def check_against_sdpa(fn: Callable, q, k, v, causal: bool, dout=None) -> Optional[str]:
    """None when ``fn(q, k, v, causal)`` (BHSD) matches torch SDPA on these inputs within a loose
    fp16 tolerance, else why not (an exception counts as a disagreement). With ``dout`` the
    gradients with respect to q, k, v (``autograd.grad``, so the inputs must require grad) are
    compared too."""
    from torch.nn.attention import sdpa_kernel

    F = torch.nn.functional
    inputs = (q, k, v)
    try:
        with torch.no_grad() if dout is None else torch.enable_grad():
            out = fn(q, k, v, causal)
            grads = None if dout is None else torch.autograd.grad(out, inputs, dout)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"raised {type(e).__name__}: {first[:200]}"
    with sdpa_kernel([sdpa_reference_backend(q.device.type)]):
        with torch.no_grad() if dout is None else torch.enable_grad():
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            ref_grads = None if dout is None else torch.autograd.grad(ref, inputs, dout)
    problem = _mismatch("output", out, ref, FWD_TOL)
    if problem is None and grads is not None:
        for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
            problem = _mismatch(name, g, rg, BWD_TOL)
            if problem:
                break
    return problem


_LOADED: Optional[MemEffSm75] = None
_LOADED_FROM: Optional[Path] = None  # the library this process loaded (once per process)


def load() -> MemEffSm75:
    """The baseline, loaded once per process."""
    global _LOADED
    if _LOADED is None:
        _LOADED = MemEffSm75()
    return _LOADED
