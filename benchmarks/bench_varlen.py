#!/usr/bin/env python3
"""Packed documents (varlen) against what users do today: pad them to the longest.

A training batch of documents with lengths drawn from [--min-len, --max-len] until --total
tokens (seeded), causal, fp16. Ours: the varlen ops (forward, backward) on the packed tokens,
flash-attn's layout, the plan a Turing SM runs. Baselines in the same run: torch SDPA's
memory-efficient kernel on the same documents right-padded to the longest (B = number of
documents, causal; right padding with a causal mask needs no key-padding mask, the cheapest
form of that baseline) and our own dense op on the padded batch. Throughput counts the real
tokens only: tokens/s = total / time.

    python benchmarks/bench_varlen.py [--d 128] [--total 16384] [--heads 16] [--dropout 0.1]

``--dropout P``: every side with attention dropout p (ours: ``varlen_fwd_dropout`` with its
``torch.randint`` draw of the seed pair timed in, and the backward regenerating the mask; the
padded dense op ``fwd_dropout``; SDPA with ``dropout_p``).

Writes <out-dir>/<tag>.txt and .json (default bench_out/bench_varlen.*).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


def doc_lengths(total: int, lo: int, hi: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < total:
        lens.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
    lens[-1] -= sum(lens) - total
    if lens[-1] < lo and len(lens) > 1:  # fold a short remainder into the previous document
        last = lens.pop()
        lens[-1] += last
    return lens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_table_bench_args(ap, d=[128], n=[16384], tag="bench_varlen")
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                    help="one batch of documents per seed")
    ap.add_argument("--dropout", type=float, default=0.0, metavar="P",
                    help="attention dropout probability on every side (0: none)")
    args = ap.parse_args(argv)
    p = args.dropout
    setup = C.table_bench_setup("bench_varlen")
    if setup is None:
        return 2
    op_fwd, op_bwd, efficient, env = setup
    ops = torch.ops.flash_attention_sm75
    rows, records = [], []
    h = args.heads
    for d in args.d:
        for total in args.n:
            for seed in args.seeds:
                lens = doc_lengths(total, args.min_len, args.max_len, seed)
                b, longest = len(lens), max(lens)
                cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).cuda()
                g = torch.Generator().manual_seed(seed)
                q, k, v, do = (torch.randn(total, h, d, generator=g).to("cuda", torch.float16)
                               for _ in range(4))
                scale = d ** -0.5
                def varlen_fwd():
                    if not p:
                        return ops.varlen_fwd(q, k, v, cu, cu, longest, longest, scale, True)
                    # the seed pair as the door draws it, per call (_ops.call_varlen_fwd)
                    st = torch.randint(0, 2 ** 62, (2,), dtype=torch.int64, device="cuda")
                    return ops.varlen_fwd_dropout(q, k, v, cu, cu, longest, longest, p, st,
                                                  scale, True)

                fwd = C.bench(varlen_fwd, "cuda", args.warmup_ms, args.rep_ms)["ms"]
                state = torch.tensor([1, 4], dtype=torch.int64, device="cuda")
                drop = dict(dropout_p=p, rng_state=state) if p else {}
                out, lse = (ops.varlen_fwd_dropout(q, k, v, cu, cu, longest, longest, p, state,
                                                   scale, True) if p else varlen_fwd())
                bwd = None if args.no_backward else C.bench(
                    lambda: ops.varlen_bwd(do, q, k, v, out, lse, cu, cu, longest, longest,
                                           scale, True, **drop), "cuda", args.warmup_ms,
                    args.rep_ms)["ms"]
                # The padded batch (B, longest, H, d), right-padded.
                pad = [torch.zeros(b, longest, h, d, dtype=torch.float16, device="cuda")
                       for _ in range(4)]
                for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
                    for t, src in zip(pad, (q, k, v, do)):
                        t[i, :e - s] = src[s:e]
                qp, kp, vp, dop = pad
                def padded_fwd():
                    if p:
                        return ops.fwd_dropout(qp, kp, vp, p, scale, True, True)
                    return op_fwd(qp, kp, vp, scale, True, True)

                pfwd = C.bench(padded_fwd, "cuda", args.warmup_ms, args.rep_ms)["ms"]
                po, plse, *pstate = padded_fwd()
                pdrop = dict(dropout_p=p, rng_state=pstate[0]) if p else {}
                pbwd = None if args.no_backward else C.bench(
                    lambda: op_bwd(dop, qp, kp, vp, po, plse, scale, True, True, None, None,
                                   True, **pdrop), "cuda", args.warmup_ms, args.rep_ms)["ms"]
                qb, kb, vb, dob = (t.transpose(1, 2) for t in pad)
                eff_f, eff_b = C.sdpa_fwd_bwd(efficient, qb, kb, vb, dob, args.warmup_ms,
                                              args.rep_ms, backward=not args.no_backward,
                                              is_causal=True, dropout_p=p)
                del pad, qp, kp, vp, dop, qb, kb, vb, dob, po, plse

                def both(f, bw):
                    return None if f is None or bw is None else f + bw

                ours, padded, eff = both(fwd, bwd), both(pfwd, pbwd), both(eff_f, eff_b)
                tps = lambda ms: None if ms is None else total / (ms * 1e-3)  # noqa: E731
                rec = dict(d=d, total=total, seed=seed, docs=b, longest=longest, lengths=lens,
                           dropout_p=p,
                           ours_fwd_ms=fwd, ours_bwd_ms=bwd, padded_fwd_ms=pfwd,
                           padded_bwd_ms=pbwd, efficient_fwd_ms=eff_f, efficient_bwd_ms=eff_b,
                           ours_tokens_per_s=tps(ours), efficient_tokens_per_s=tps(eff),
                           fwd_bwd_ratio_vs_efficient=C.speedup(ours, eff))
                records.append(rec)
                rows.append([f"d={d}", total, seed, b, longest, C.fmt(fwd, ".3f"),
                             C.fmt(bwd, ".3f"), C.fmt(padded, ".3f"), C.fmt(eff, ".3f"),
                             C.fmt(None if tps(ours) is None else tps(ours) / 1e6, ".2f"),
                             C.fmt(None if tps(eff) is None else tps(eff) / 1e6, ".2f"),
                             C.fmt_speedup(ours, eff), C.fmt_speedup(ours, padded)])
                print(rows[-1], flush=True)
    head = (f"packed causal documents of {args.min_len}-{args.max_len} tokens, fp16, H={h}, "
            f"dropout_p={p:g}; "
            f"ours = varlen fwd + bwd (deterministic dQ) on the packed tokens; padded = our dense "
            f"op on the documents right-padded to the longest; eff = SDPA mem-efficient on that "
            f"padded batch (is_causal), same run; Mtok/s = real tokens per second, fwd + bwd")
    C.write_table_bench(args, env, "bench_varlen.py", head,
                        ["case", "tokens", "seed", "docs", "longest", "fwd ms", "bwd ms",
                         "padded f+b ms", "eff f+b ms", "ours Mtok/s", "eff Mtok/s",
                         "eff/ours", "padded/ours"], rows, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
