"""Python host time per forward call of our wrappers vs torch's SDPA, on tiny CPU tensors.

Measures the Python + dispatcher time that also precedes every GPU launch. The C++ CPU
reference kernel of the op costs ~180 us even at (B=1, H=1, seqlen 1, d=64) (two dozen ATen
ops) and varies by tens of us between runs, which hides differences of a few us; so by default
the op's CPU kernel is replaced, in this process only, by a Python stub that just allocates the
two outputs (~6 us, the same for every case). Differences between rows are then host overhead.
``--real-op`` keeps the C++ kernel. Runs anywhere:

    python3 benchmarks/host_overhead.py                  # table, best of --repeats runs
    python3 benchmarks/host_overhead.py --profile NAME   # cProfile of one case (e.g. flash_attn_func)

The SDPA wrapper falls back to torch for CPU tensors. Its kernel path is measured as
``sdpa (kernel path)`` by letting the wrapper take CPU tensors (``sdpa._KERNEL_DEVICE_TYPE`` set to
"cpu" and the compute-capability query patched out for that case only, so the number misses the
cost of ``torch.cuda.get_device_capability``).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import sys
import time
import warnings
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flash_attention_sm75 as fa  # noqa: E402
from flash_attention_sm75 import sdpa as _sdpa  # noqa: E402


@contextlib.contextmanager
def _sdpa_kernel_path_on_cpu():
    """Let the SDPA wrapper's kernel path take CPU tensors (for timing only): its device rule
    reads "cpu" and the CUDA compute-capability query answers (7, 5) (the real query's cost,
    GPU-only, is not in the number)."""
    with mock.patch.object(_sdpa, "_KERNEL_DEVICE_TYPE", "cpu"), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (7, 5)):
        yield


def _stub_cpu_kernel(q, k, v, softmax_scale=None, is_causal=False, causal_bottom_right=True,
                     leftpad_k=None, seqused_k=None):
    b, s, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, s), dtype=torch.float32)


def install_stub() -> None:
    lib = torch.library.Library("flash_attention_sm75", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
        lib.impl("fwd", _stub_cpu_kernel, "CPU")
    install_stub.lib = lib  # the registration lives as long as the Library object


def _below_autograd(op, q, k, v):
    # The floor for the wrappers: the op without its (Python) autograd kernel.
    with torch._C._AutoDispatchBelowAutograd():
        return op(q, k, v, None, False, True)


def cases(requires_grad: bool):
    bhsd = [torch.randn(1, 1, 1, 64, dtype=torch.float16, requires_grad=requires_grad)
            for _ in range(3)]
    bshd = [torch.randn(1, 1, 1, 64, dtype=torch.float16, requires_grad=requires_grad)
            for _ in range(3)]
    q, k, v = bshd
    qh, kh, vh = bhsd
    op = torch.ops.flash_attention_sm75.fwd
    return {
        "op fwd (raw)": lambda: op(q, k, v, None, False, True),
        "op fwd.default": lambda: op.default(q, k, v, None, False, True),
        "op fwd below autograd": lambda: _below_autograd(op, q, k, v),
        "flash_attn_func": lambda: fa.flash_attn_func(q, k, v),
        "flash_attention_forward": lambda: fa.flash_attention_forward(qh, kh, vh),
        "sdpa (CPU fallback)": lambda: fa.scaled_dot_product_attention(qh, kh, vh),
        "torch F.sdpa": lambda: F.scaled_dot_product_attention(qh, kh, vh),
    }


def time_per_call(fn, n: int, repeats: int) -> float:
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best  # the least disturbed run (2-core machine, other processes)


def kernel_path_sdpa(requires_grad: bool):
    qh, kh, vh = [torch.randn(1, 1, 1, 64, dtype=torch.float16, requires_grad=requires_grad)
                  for _ in range(3)]
    return lambda: fa.scaled_dot_product_attention(qh, kh, vh)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000, help="calls per timed run")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--profile", default=None, help="cProfile this case (name from the table)")
    p.add_argument("--grad", action="store_true", help="with --profile: inputs require grad")
    p.add_argument("--real-op", action="store_true", help="keep the C++ CPU kernel (no stub)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if not args.real_op:
        install_stub()

    if args.profile:
        fns = cases(args.grad)
        fns["sdpa (kernel path)"] = kernel_path_sdpa(args.grad)
        fn = fns[args.profile]
        with _sdpa_kernel_path_on_cpu() if "kernel" in args.profile else contextlib.nullcontext():
            for _ in range(200):
                fn()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.n):
                fn()
            prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return

    kernel = "C++ CPU kernel" if args.real_op else "stub CPU kernel"
    print(f"torch {torch.__version__}, us per call, best of {args.repeats} x {args.n} calls, "
          f"B=1 H=1 S=1 d=64 fp16 CPU, {kernel}")
    print(f"| case | no grad | no_grad() block | requires_grad |")
    print(f"|---|---|---|---|")
    rows = {}
    for rg in (False, True):
        for name, fn in cases(rg).items():
            rows.setdefault(name, []).append(time_per_call(fn, args.n, args.repeats))
            if not rg:
                with torch.no_grad():
                    rows[name].append(time_per_call(fn, args.n, args.repeats))
        with _sdpa_kernel_path_on_cpu():
            name, fn = "sdpa (kernel path)", kernel_path_sdpa(rg)
            rows.setdefault(name, []).append(time_per_call(fn, args.n, args.repeats))
            if not rg:
                with torch.no_grad():
                    rows[name].append(time_per_call(fn, args.n, args.repeats))
    for name, (a, b, c) in rows.items():
        print(f"| {name} | {a:.1f} | {b:.1f} | {c:.1f} |")


if __name__ == "__main__":
    main()
