#!/usr/bin/env python3
"""Attention with a mask or bias (torch's ``attn_mask``): our kernels reading ``attn_bias`` in
place against torch SDPA's memory-efficient kernel given the same mask, in the same run.

Cases (non-causal, fp16 q/k/v, B x H x N x N scores):

* ``bias-bhnn``: an fp16 (B, H, N, N) additive bias (T5-style position bias, ALiBi as a mask);
* ``bias-b1nn``: an fp16 (B, 1, N, N) bias broadcast over heads (diffusers / block masks);
* ``mask-b1nn``: a bool (B, 1, N, N) mask, ~10% of keys hidden per row at random;
* ``pad-b11n``: a bool (B, 1, 1, N) key-padding mask (the kernel reads it as a bias here; the
  SDPA wrapper would run it as key ranges);
* ``none``: our kernel without a bias; ``ext``: the extended instantiation (the one that reads
  biases) without one (zero ALiBi slopes): with ``none``, what the bias's reads cost;
* ``grad-bhnn`` / ``grad-1hnn``: an fp16 (B, H, N, N) / (1, H, N, N) bias that requires grad (a
  learned position bias: T5, Swin): both sides also compute its gradient (ours: ``bwd_dbias``
  and the sum over the broadcast batch; mem-efficient: its grad_bias).

Times: forward, and forward + backward (the bias's gradient only in the ``grad-*`` cases). The plan is the Turing one (``FLASH_SM75_DEVICE_PROFILE=t4``,
the benchmarks' default). TFLOP/s count 4 * B * H * N^2 * d forward, 2.5x that backward.

    python benchmarks/bench_bias.py [--d 64 128] [--n 1024 4096] [--batch 4] [--heads 16]

Writes <out-dir>/<tag>.txt and .json (default bench_out/bench_bias.*).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

CASES = ("none", "ext", "pad-b11n", "mask-b1nn", "bias-b1nn", "bias-bhnn", "grad-bhnn",
         "grad-1hnn")


def make_bias(case: str, b: int, h: int, n: int, gen: torch.Generator):
    if case in ("none", "ext"):
        return None
    if case == "pad-b11n":
        lengths = torch.randint(n // 2, n + 1, (b,), generator=gen)
        return (torch.arange(n)[None, :] < lengths[:, None]).view(b, 1, 1, n).cuda()
    if case == "mask-b1nn":
        m = torch.rand(b, 1, n, n, generator=gen) > 0.1
        m[..., 0] = True
        return m.cuda()
    # Drawn on the GPU (seeded from gen): a (B, H, N, N) bias drawn on the CPU took most of a
    # short device call at N = 4096.
    cuda_gen = torch.Generator(device="cuda").manual_seed(
        int(torch.randint(0, 2**62, (1,), generator=gen)))
    if case.startswith("grad"):
        lead = b if case == "grad-bhnn" else 1
        return torch.randn(lead, h, n, n, generator=cuda_gen, device="cuda",
                           dtype=torch.float16)
    heads = h if case == "bias-bhnn" else 1
    return torch.randn(b, heads, n, n, generator=cuda_gen, device="cuda", dtype=torch.float16)



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_table_bench_args(ap, d=[64, 128], n=[1024, 4096], tag="bench_bias")
    ap.set_defaults(batch=4)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    args = ap.parse_args(argv)
    setup = C.table_bench_setup("bench_bias")
    if setup is None:
        return 2
    op_fwd, op_bwd, efficient, env = setup
    from flash_attention_sm75._ops import reduce_dbias
    bench = lambda fn: C.bench(fn, "cuda", args.warmup_ms, args.rep_ms)["ms"]  # noqa: E731
    rows, records = [], []
    for d, n, g, q, k, v, do in C.table_problems(args):
        scale = d ** -0.5
        flop = 4.0 * args.batch * args.heads * d * n * n
        qb, kb, vb, dob = (t.transpose(1, 2) for t in (q, k, v, do))
        for case in args.cases:
            bias = make_bias(case, args.batch, args.heads, n, g)
            slopes = torch.zeros(args.heads, device="cuda") if case == "ext" else None
            call = lambda: op_fwd(q, k, v, scale, False, True, None, None, -1, -1, 0.0,  # noqa: E731
                                  slopes, bias)
            fwd = bench(call)
            out, lse = call()
            grad = case.startswith("grad")

            def backward():
                if not grad:
                    return op_bwd(do, q, k, v, out, lse, scale, False, True, None, None, True,
                                  None, -1, -1, 0.0, slopes, bias)
                res = torch.ops.flash_attention_sm75.bwd_dbias(
                    do, q, k, v, out, lse, scale, False, True, None, None, True, None, -1, -1,
                    0.0, slopes, bias)
                return res[:3] + (reduce_dbias(res[3], bias),)

            bwd = None if args.no_backward else bench(backward)
            base_f = base_b = None
            if bias is not None:
                try:
                    with C.sdpa_context(efficient):
                        sdpa = lambda a, b_, c, m=bias: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731,E501
                            a, b_, c, attn_mask=m, scale=scale)
                        # grad-*: the bias a leaf too (its gradient computed, as ours)
                        base_f, base_b = C.fwd_bwd_times(sdpa, qb, kb, vb, dob, bench,
                                                         not args.no_backward,
                                                         (bias,) if grad else ())
                except RuntimeError as e:
                    print(f"mem-efficient failed at d={d} N={n} {case}: {str(e)[:120]}")
            ratio = lambda a, b_: None if a is None or b_ is None else b_ / a  # noqa: E731
            fb = None if bwd is None else fwd + bwd
            base_fb = None if base_f is None or base_b is None else base_f + base_b
            rec = dict(d=d, n=n, case=case, batch=args.batch, heads=args.heads,
                       ours_fwd_ms=fwd, ours_bwd_ms=bwd, eff_fwd_ms=base_f, eff_bwd_ms=base_b,
                       ours_fwd_tflops=C.tflops(flop, fwd),
                       ours_bwd_tflops=C.tflops(2.5 * flop, bwd),
                       fwd_speedup=ratio(fwd, base_f), fwd_bwd_speedup=ratio(fb, base_fb))
            records.append(rec)
            rows.append([f"d={d}", n, case, C.fmt(fwd, ".3f"),
                         C.fmt(rec["ours_fwd_tflops"], ".1f"), C.fmt(base_f, ".3f"),
                         C.fmt(rec["fwd_speedup"], ".2f") + "x", C.fmt(bwd, ".3f"),
                         C.fmt(base_b, ".3f"), C.fmt(rec["fwd_bwd_speedup"], ".2f") + "x"])
            print(rows[-1], flush=True)
            bias = None  # free the N x N tensor before the next case
    head = (f"non-causal, fp16, B={args.batch}, H={args.heads}; ours = the op with attn_bias "
            f"(T4 plan), eff = torch SDPA memory-efficient with the same attn_mask; TF = "
            f"TFLOP/s; eff/ours = t_eff / t_ours, same run")
    C.write_table_bench(args, env, "bench_bias.py", head,
                        ["case", "N", "bias", "fwd ms", "fwd TF", "eff fwd ms", "eff/ours",
                         "bwd ms", "eff bwd ms", "fwd+bwd eff/ours"], rows, records,
                        left=(0, 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
