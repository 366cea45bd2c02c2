#!/usr/bin/env python3
"""Attention dropout in training: our kernels (``flash_attn_func(..., dropout_p=p)``, forward and
backward through autograd) against torch SDPA's memory-efficient kernel with the same
``dropout_p``, in the same run, and against our own call without dropout (what the generator
costs).

Cases (fp16 q/k/v of (B, N, H, d), causal and not): ``p=0`` (ours without dropout; the
baseline's row is mem-efficient without dropout too) and ``p=<--p>``. Times: forward, and
forward + backward (autograd, one recorded forward, ``torch.autograd.grad``). The plan is the
Turing one (``FLASH_SM75_DEVICE_PROFILE=t4``, the benchmarks' default). TFLOP/s count 4 * B * H *
N^2 * d forward (halved when causal), 3.5x that forward + backward.

    python benchmarks/bench_dropout.py [--d 64 128] [--n 1024 4096] [--p 0.1]

Writes <out-dir>/<tag>.txt and .json (default bench_out/bench_dropout.*).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_table_bench_args(ap, d=[64, 128], n=[1024, 4096], tag="bench_dropout")
    ap.set_defaults(batch=4)
    ap.add_argument("--p", type=float, default=0.1, help="dropout probability (default 0.1)")
    ap.add_argument("--causal", nargs="+", type=int, default=[0, 1], choices=[0, 1])
    args = ap.parse_args(argv)
    setup = C.table_bench_setup("bench_dropout")
    if setup is None:
        return 2
    _, _, efficient, env = setup
    import flash_attention_sm75 as fa

    bench = lambda fn: C.bench(fn, "cuda", args.warmup_ms, args.rep_ms)["ms"]  # noqa: E731
    rows, records = [], []
    for d, n, _, q, k, v, do in C.table_problems(args):
        qb, kb, vb, dob = (t.transpose(1, 2) for t in (q, k, v, do))
        for causal in (bool(c) for c in args.causal):
            flop = 4.0 * args.batch * args.heads * d * n * n / (2 if causal else 1)
            for p in (0.0, args.p):
                ours = lambda a, b_, c, p=p: fa.flash_attn_func(  # noqa: E731
                    a, b_, c, causal=causal, dropout_p=p)
                fwd, bwd = C.fwd_bwd_times(ours, q, k, v, do, bench, not args.no_backward)
                base_f = base_b = None
                try:
                    with C.sdpa_context(efficient):
                        eff = lambda a, b_, c, p=p: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                            a, b_, c, dropout_p=p, is_causal=causal)
                        base_f, base_b = C.fwd_bwd_times(eff, qb, kb, vb, dob, bench,
                                                         not args.no_backward)
                except RuntimeError as e:
                    print(f"mem-efficient failed at d={d} N={n} p={p}: {str(e)[:120]}")
                ratio = lambda a, b_: None if a is None or b_ is None else b_ / a  # noqa: E731
                fb = None if bwd is None else fwd + bwd
                base_fb = None if base_f is None or base_b is None else base_f + base_b
                rec = dict(d=d, n=n, causal=causal, dropout_p=p, batch=args.batch,
                           heads=args.heads, ours_fwd_ms=fwd, ours_fwd_bwd_ms=fb,
                           eff_fwd_ms=base_f, eff_fwd_bwd_ms=base_fb,
                           ours_fwd_tflops=C.tflops(flop, fwd),
                           ours_fwd_bwd_tflops=C.tflops(3.5 * flop, fb),
                           fwd_speedup=ratio(fwd, base_f), fwd_bwd_speedup=ratio(fb, base_fb))
                records.append(rec)
                rows.append([f"d={d}", n, "causal" if causal else "full", p, C.fmt(fwd, ".3f"),
                             C.fmt(base_f, ".3f"), C.fmt(rec["fwd_speedup"], ".2f") + "x",
                             C.fmt(fb, ".3f"), C.fmt(rec["ours_fwd_bwd_tflops"], ".1f"),
                             C.fmt(base_fb, ".3f"), C.fmt(rec["fwd_bwd_speedup"], ".2f") + "x"])
                print(rows[-1], flush=True)
    head = (f"fp16, B={args.batch}, H={args.heads}; ours = flash_attn_func(dropout_p=p) with "
            f"autograd (T4 plan), eff = torch SDPA memory-efficient with the same dropout_p; "
            f"TF = TFLOP/s (fwd+bwd: 3.5x the forward's FLOP); eff/ours = t_eff / t_ours, "
            f"same run")
    C.write_table_bench(args, env, "bench_dropout.py", head,
                        ["case", "N", "mask", "p", "fwd ms", "eff fwd ms", "eff/ours",
                         "fwd+bwd ms", "fwd+bwd TF", "eff fwd+bwd ms", "fwd+bwd eff/ours"],
                        rows, records, left=(0, 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
