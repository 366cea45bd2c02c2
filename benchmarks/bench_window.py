#!/usr/bin/env python3
"""Sliding-window attention: the cost follows the window, not the sequence.

For causal attention with a window of W keys (flash-attn's ``window_size = (W - 1, 0)``, what
Mistral / Gemma / Qwen2 sliding layers compute) and without one, times our forward and backward
(the op, BSHD) and torch SDPA's memory-efficient kernel given the same band as a boolean mask
(the only way torch's SDPA takes a window), in the same run. TFLOP/s count the visible
(query, key) pairs only: 4 * B * H * d * pairs forward, 2.5x that backward.

    python benchmarks/bench_window.py [--d 64 128] [--n 4096 8192 16384] [--window 256 1024 4096]

Writes <out-dir>/<tag>.txt and .json (default bench_out/bench_window.*).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


def visible_pairs(n: int, window) -> int:
    """Visible (query, key) pairs of causal attention over n tokens with a window of W keys."""
    if window is None or window >= n:
        return n * (n + 1) // 2
    return n * window - window * (window - 1) // 2


def band_mask(n: int, window, device) -> torch.Tensor:
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    vis = j <= i
    if window is not None:
        vis &= j > i - window
    return vis[None, None]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_table_bench_args(ap, d=[64, 128], n=[4096, 8192, 16384], tag="bench_window")
    ap.add_argument("--window", type=int, nargs="+", default=[256, 1024, 4096])
    args = ap.parse_args(argv)
    setup = C.table_bench_setup("bench_window")
    if setup is None:
        return 2
    op_fwd, op_bwd, efficient, env = setup
    rows, records = [], []
    for d, n, g, q, k, v, do in C.table_problems(args):
        scale = d ** -0.5
        # W = n hides nothing (the kernels run it as plain causal); W = n - 1 hides one key.
        for window in [None] + [w for w in args.window if w <= n]:
            ws = (-1, -1) if window is None else (window - 1, 0)
            pairs = visible_pairs(n, window)
            flop = 4.0 * args.batch * args.heads * d * pairs
            fwd = C.bench(lambda: op_fwd(q, k, v, scale, True, True, None, None, *ws), "cuda",
                          args.warmup_ms, args.rep_ms)["ms"]
            out, lse = op_fwd(q, k, v, scale, True, True, None, None, *ws)
            bwd = None if args.no_backward else C.bench(
                lambda: op_bwd(do, q, k, v, out, lse, scale, True, True, None, None, True,
                               None, *ws), "cuda", args.warmup_ms, args.rep_ms)["ms"]
            qb, kb, vb, dob = (t.transpose(1, 2) for t in (q, k, v, do))
            eff_f, eff_b = C.sdpa_fwd_bwd(efficient, qb, kb, vb, dob, args.warmup_ms,
                                          args.rep_ms, backward=not args.no_backward,
                                          attn_mask=band_mask(n, window, "cuda"))
            rec = dict(d=d, n=n, window=window, pairs=pairs, ours_fwd_ms=fwd,
                       ours_bwd_ms=bwd, efficient_fwd_ms=eff_f, efficient_bwd_ms=eff_b,
                       ours_fwd_tflops=C.tflops(flop, fwd),
                       ours_bwd_tflops=C.tflops(2.5 * flop, bwd))
            records.append(rec)
            rows.append([f"d={d}", n, "-" if window is None else window,
                         C.fmt(fwd, ".3f"), C.fmt(rec["ours_fwd_tflops"], ".1f"),
                         C.fmt(eff_f, ".3f"), C.fmt_speedup(fwd, eff_f),
                         C.fmt(bwd, ".3f"), C.fmt(rec["ours_bwd_tflops"], ".1f"),
                         C.fmt(eff_b, ".3f"), C.fmt_speedup(bwd, eff_b)])
            print(rows[-1], flush=True)
    head = (f"causal sliding window, fp16, B={args.batch}, H={args.heads}; window W = "
            f"window_size (W - 1, 0), '-' = no window; TF = TFLOP/s over visible pairs; eff = "
            f"SDPA mem-efficient with the band as a bool mask, same run; eff/ours = t_eff / t_ours")
    C.write_table_bench(args, env, "bench_window.py", head,
                        ["case", "N", "W", "fwd ms", "fwd TF", "eff fwd ms", "eff/ours",
                         "bwd ms", "bwd TF", "eff bwd ms", "eff/ours"], rows, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
