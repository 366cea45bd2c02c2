#!/usr/bin/env python3
"""Score modifiers: what softcap (Gemma 2) and ALiBi (BLOOM, MPT) cost on the kernels, and what
Turing users run for them without us.

For causal attention, times in the same run: our forward and backward (the op, BSHD) plain, with
``softcap`` and with ``alibi_slopes``; Gemma 2's fallback, the eager attention transformers runs
for a softcap (fp16 matmul, tanh, fp32 softmax, matmul: the N x N scores in memory); and ALiBi's,
torch SDPA's memory-efficient kernel with the bias as a float mask (B, H, N, N). TFLOP/s count
the causal half: 2 * B * H * d * N^2 forward, 2.5x that backward.

    python benchmarks/bench_scoremod.py [--d 128 256] [--n 1024 4096 8192]

Writes <out-dir>/<tag>.txt and .json (default bench_out/bench_scoremod.*).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

GEMMA2_SOFTCAP = 50.0


def alibi_slopes(h: int) -> torch.Tensor:
    """BLOOM's slopes for a power-of-two head count: 2^(-8 i / h), i = 1 .. h."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, n: int) -> torch.Tensor:
    """(1, H, N, N) fp16 causal ALiBi bias: -slope * (i - j) visible, -inf above the diagonal."""
    i = torch.arange(n, device=slopes.device)[:, None]
    j = torch.arange(n, device=slopes.device)[None, :]
    bias = -slopes.view(-1, 1, 1) * (i - j).abs().float()
    return bias.masked_fill(j > i, float("-inf")).unsqueeze(0).half()


def eager_softcap(q, k, v, scale, softcap):
    """transformers' eager attention for Gemma 2 (BHSD, causal), in fp16 with an fp32 softmax."""
    n = q.shape[-2]
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    s = s.masked_fill(causal, float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_table_bench_args(ap, d=[128, 256], n=[1024, 4096, 8192], tag="bench_scoremod")
    ap.add_argument("--no-baselines", action="store_true")
    args = ap.parse_args(argv)
    setup = C.table_bench_setup("bench_scoremod")
    if setup is None:
        return 2
    op_fwd, op_bwd, efficient, env = setup
    slopes = alibi_slopes(args.heads).cuda()
    bench = lambda fn: C.bench(fn, "cuda", args.warmup_ms, args.rep_ms)["ms"]  # noqa: E731
    rows, records = [], []
    for d, n, g, q, k, v, do in C.table_problems(args):
        scale = d ** -0.5
        flop = 2.0 * args.batch * args.heads * d * n * n
        qb, kb, vb, dob = (t.transpose(1, 2) for t in (q, k, v, do))
        for mod, cap, sl in (("plain", 0.0, None), ("softcap", GEMMA2_SOFTCAP, None),
                             ("alibi", 0.0, slopes)):
            call = lambda: op_fwd(q, k, v, scale, True, True, None, None, -1, -1, cap, sl)  # noqa: E731
            fwd = bench(call)
            out, lse = call()
            bwd = None if args.no_backward else bench(
                lambda: op_bwd(do, q, k, v, out, lse, scale, True, True, None, None, True,
                               None, -1, -1, cap, sl))
            base_f = base_b = None
            base_name = "-"
            if not args.no_baselines and mod != "plain":
                try:
                    if mod == "softcap":
                        base_name = "eager"
                        base = lambda a, b, c: eager_softcap(a, b, c, scale, cap)  # noqa: E731
                        ctx = torch.enable_grad
                    else:
                        base_name = "eff+bias"
                        bias = alibi_bias(slopes, n)
                        base = lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                            a, b, c, attn_mask=bias)
                        ctx = lambda: C.sdpa_context(efficient)  # noqa: E731
                    with ctx():
                        base_f, base_b = C.fwd_bwd_times(base, qb, kb, vb, dob, bench,
                                                         not args.no_backward)
                except RuntimeError as e:  # out of memory for the N x N scores
                    print(f"{base_name} failed at d={d} N={n}: {str(e)[:120]}")
            rec = dict(d=d, n=n, mod=mod, ours_fwd_ms=fwd, ours_bwd_ms=bwd,
                       baseline=base_name, baseline_fwd_ms=base_f, baseline_bwd_ms=base_b,
                       ours_fwd_tflops=C.tflops(flop, fwd),
                       ours_bwd_tflops=C.tflops(2.5 * flop, bwd))
            records.append(rec)
            ratio = lambda a, b: None if a is None or b is None else b / a  # noqa: E731
            rows.append([f"d={d}", n, mod, C.fmt(fwd, ".3f"),
                         C.fmt(rec["ours_fwd_tflops"], ".1f"), C.fmt(bwd, ".3f"),
                         C.fmt(rec["ours_bwd_tflops"], ".1f"), base_name,
                         C.fmt(base_f, ".3f"), C.fmt(ratio(fwd, base_f), ".2f") + "x",
                         C.fmt(base_b, ".3f"), C.fmt(ratio(bwd, base_b), ".2f") + "x"])
            print(rows[-1], flush=True)
    head = (f"causal, fp16, B={args.batch}, H={args.heads}; softcap = {GEMMA2_SOFTCAP:g} "
            f"(Gemma 2), alibi = BLOOM's slopes; TF = TFLOP/s; baseline: 'eager' = transformers' "
            f"eager attention (what Gemma 2 runs with a softcap), 'eff+bias' = SDPA mem-efficient "
            f"with the ALiBi bias as a float mask; base/ours = t_base / t_ours, same run")
    C.write_table_bench(args, env, "bench_scoremod.py", head,
                        ["case", "N", "mod", "fwd ms", "fwd TF", "bwd ms", "bwd TF", "baseline",
                         "base fwd ms", "base/ours", "base bwd ms", "base/ours"], rows, records,
                        left=(0, 2, 7))
    return 0


if __name__ == "__main__":
    sys.exit(main())
