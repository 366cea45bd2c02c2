#!/usr/bin/env python3
"""Decode (one query token per sequence) against a KV cache: bytes of K/V read per second,
against the device-to-device copy bandwidth measured in the same run.

For every (d, batch, cache length, GQA ratio) of the sweep, with full caches (every sequence
``cache`` keys; ``--lengths half`` for lengths uniform in [cache / 2, cache], seeded):
  * ours: ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=...)`` as users call it
    (the door's checks, one KV-cache op call: the split-KV decode kernel);
  * op: the op alone (``_ops.call_kvcache_fwd``), which shows the door's host time;
  * paged: the same call on the same rows as shuffled pages of ``--page`` keys (block_table);
  * eff: torch SDPA mem-efficient with K/V expanded to the q-heads beforehand (untimed), the
    per-sequence lengths as a bool mask (none with full caches).
KV GB/s = bytes of the attended K and V rows / time; "% copy" = that over the copy bandwidth
(bytes read + written by ``dst.copy_(src)`` of ``--copy-mib`` MiB / time).

    python benchmarks/bench_decode.py [--d 64 128 256] [--batch 1 4 16 64]
        [--cache 512 2048 4096 16384 32768] [--ratio 1 4 8] [--heads 32]

Writes <out-dir>/<tag>.txt, .json and .png (default bench_out/bench_decode.*). The planning profile
is the benchmarks' default (t4: the launches a T4 would run, on this GPU's SMs).
"""
from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


def copy_bandwidth(mib: int, warmup_ms: float, rep_ms: float) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second."""
    n = mib << 20
    src = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    ms = C.bench(lambda: dst.copy_(src), "cuda", warmup_ms, rep_ms)["ms"]
    return 2 * n / (ms * 1e-3)


def plot(records, path: str, suptitle: str = ""):
    """One panel per (d, GQA ratio): % of the copy bandwidth against the cache length, one
    series per batch size (the op alone and the door), the 70% line."""
    panels = []
    for d in sorted({r["d"] for r in records}):
        for ratio in sorted({r["ratio"] for r in records}):
            rs = [r for r in records if r["d"] == d and r["ratio"] == ratio]
            if not rs:
                continue
            xs = sorted({r["cache"] for r in rs})
            series = {}
            for b in sorted({r["batch"] for r in rs}):
                by = {r["cache"]: r for r in rs if r["batch"] == b}
                series[f"B={b}"] = [by[x]["pct_copy"] if x in by else None for x in xs]
            panels.append(dict(title=f"d={d}, h/h_k={ratio}", x=xs, series=series,
                               xlabel="cache keys", ylabel="% of copy bandwidth", logx2=True,
                               ymin0=True, hline=(70, "70%")))
    return C.plot_panels(path, panels, ncols=3, suptitle=suptitle)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--cache", type=int, nargs="+", default=[512, 2048, 4096, 16384, 32768])
    ap.add_argument("--ratio", type=int, nargs="+", default=[1, 4, 8], help="h / h_k")
    ap.add_argument("--heads", type=int, default=32, help="query heads")
    ap.add_argument("--page", type=int, default=256, help="page_block_size of the paged cache")
    ap.add_argument("--lengths", choices=["full", "half"], default="full")
    ap.add_argument("--max-gib", type=float, default=8.0,
                    help="skip shapes whose K + V exceed this many GiB")
    ap.add_argument("--copy-mib", type=int, default=1024)
    ap.add_argument("--no-efficient", action="store_true")
    ap.add_argument("--group-rows", action="store_true",
                    help="also time GQA calls (ratio > 1) with FLASH_SM75_DECODE_GQA=prefill: the "
                         "group's q-heads as query rows of the prefill kernels (rows columns)")
    ap.add_argument("--out-dir", default="bench_out")
    ap.add_argument("--tag", default="bench_decode")
    ap.add_argument("--warmup-ms", type=float, default=10)
    ap.add_argument("--rep-ms", type=float, default=40)
    args = ap.parse_args(argv)
    setup = C.table_bench_setup("bench_decode")
    if setup is None:
        return 2
    _, _, efficient, env = setup
    from flash_attention_sm75 import _ops, fa2

    copy_bw = copy_bandwidth(args.copy_mib, args.warmup_ms, args.rep_ms)
    print(f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write)", flush=True)
    rows, records = [], []
    h = args.heads
    for d in args.d:
        for ratio in args.ratio:
            hk = h // ratio
            for b in args.batch:
                for cache in args.cache:
                    kv_bytes_all = 2 * b * cache * hk * d * 2
                    if kv_bytes_all > args.max_gib * 2**30 or cache % args.page:
                        continue
                    seed = d * 1000003 + ratio * 10007 + b * 101 + cache
                    g = torch.Generator().manual_seed(seed)
                    gc = torch.Generator(device="cuda").manual_seed(seed)
                    kc, vc = (torch.randn(b, cache, hk, d, generator=gc, device="cuda",
                                          dtype=torch.float16) for _ in range(2))
                    q = torch.randn(b, 1, h, d, generator=gc, device="cuda", dtype=torch.float16)
                    if args.lengths == "full":
                        lens = torch.full((b,), cache, dtype=torch.int32)
                    else:
                        lens = torch.randint(cache // 2, cache + 1, (b,), generator=g,
                                             dtype=torch.int32)
                    seqlens = lens.cuda()
                    kv_bytes = 2 * int(lens.sum()) * hk * d * 2
                    n = b * cache // args.page
                    perm = torch.randperm(n, generator=g).cuda()
                    pk, pv = (torch.empty((n, args.page, hk, d), device="cuda",
                                          dtype=torch.float16) for _ in range(2))
                    pk[perm] = kc.reshape(n, args.page, hk, d)
                    pv[perm] = vc.reshape(n, args.page, hk, d)
                    table = perm.view(b, cache // args.page).to(torch.int32)
                    with torch.no_grad():
                        ours = C.bench(lambda: fa2.flash_attn_with_kvcache(
                            q, kc, vc, cache_seqlens=seqlens), "cuda", args.warmup_ms,
                            args.rep_ms)["ms"]
                        op = C.bench(lambda: _ops.call_kvcache_fwd(q, kc, vc, seqlens), "cuda",
                                     args.warmup_ms, args.rep_ms)["ms"]
                        paged = C.bench(lambda: fa2.flash_attn_with_kvcache(
                            q, pk, pv, cache_seqlens=seqlens, block_table=table), "cuda",
                            args.warmup_ms, args.rep_ms)["ms"]
                        rows_ms = rows_paged = None
                        if args.group_rows and ratio > 1:
                            o_heads = fa2.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
                            # the op reads the setting per call
                            with mock.patch.dict(os.environ,
                                                 {"FLASH_SM75_DECODE_GQA": "prefill"}):
                                o_rows = fa2.flash_attn_with_kvcache(q, kc, vc,
                                                                     cache_seqlens=seqlens)
                                # never a number for a path that disagrees with the default one
                                err = (o_rows.float() - o_heads.float()).abs().max().item()
                                if not err <= 4e-3:
                                    raise SystemExit(
                                        f"bench_decode: the group-rows plan differs from the "
                                        f"decode kernel by {err} at d={d} B={b} cache={cache} "
                                        f"ratio={ratio}")
                                rows_ms = C.bench(lambda: fa2.flash_attn_with_kvcache(
                                    q, kc, vc, cache_seqlens=seqlens), "cuda", args.warmup_ms,
                                    args.rep_ms)["ms"]
                                rows_paged = C.bench(lambda: fa2.flash_attn_with_kvcache(
                                    q, pk, pv, cache_seqlens=seqlens, block_table=table),
                                    "cuda", args.warmup_ms, args.rep_ms)["ms"]
                        del pk, pv
                        eff = None
                        if not args.no_efficient:
                            kx, vx = (t.repeat_interleave(ratio, 2).transpose(1, 2)
                                      for t in (kc, vc))
                            mask = None
                            if args.lengths != "full":
                                j = torch.arange(cache, device="cuda").view(1, 1, 1, cache)
                                mask = j < seqlens.view(b, 1, 1, 1)
                            eff, _ = C.sdpa_fwd_bwd(efficient, q.transpose(1, 2), kx, vx, None,
                                                    args.warmup_ms, args.rep_ms, backward=False,
                                                    attn_mask=mask)
                            del kx, vx, mask
                    del kc, vc
                    gbs = kv_bytes / (ours * 1e-3) / 1e9
                    op_gbs = kv_bytes / (op * 1e-3) / 1e9
                    rec = dict(d=d, ratio=ratio, heads=h, heads_k=hk, batch=b, cache=cache,
                               kv_bytes=kv_bytes, ours_ms=ours, op_ms=op, paged_ms=paged,
                               efficient_ms=eff, ours_gbs=gbs, op_gbs=op_gbs,
                               copy_gbs=copy_bw / 1e9, pct_copy=100 * gbs * 1e9 / copy_bw,
                               op_pct_copy=100 * op_gbs * 1e9 / copy_bw,
                               rows_ms=rows_ms, rows_paged_ms=rows_paged,
                               rows_pct_copy=(None if rows_ms is None else
                                              100 * kv_bytes / (rows_ms * 1e-3) / copy_bw))
                    records.append(rec)
                    rows.append([f"d={d}", ratio, b, cache, C.fmt(ours, ".4f"),
                                 C.fmt(gbs, ".0f"), C.fmt(rec["pct_copy"], ".0f"),
                                 C.fmt(op, ".4f"), C.fmt(rec["op_pct_copy"], ".0f"),
                                 C.fmt(paged, ".4f"), C.fmt(paged / ours, ".2f"),
                                 C.fmt(eff, ".4f"), C.fmt_speedup(ours, eff)]
                                + ([C.fmt(rows_ms, ".4f"), C.fmt(rec["rows_pct_copy"], ".0f"),
                                    C.fmt_speedup(rows_ms, ours) if rows_ms else "-",
                                    C.fmt(rows_paged, ".4f")] if args.group_rows else []))
                    print(rows[-1], flush=True)
    head = (f"decode, fp16, H={h}, one query token, {args.lengths} caches; KV GB/s = K+V bytes "
            f"attended / time; % copy = of the copy bandwidth {copy_bw / 1e9:.0f} GB/s measured "
            f"in this run; ours = flash_attn_with_kvcache; op = the op alone; paged = pages of "
            f"{args.page} (time / ours); eff = SDPA mem-efficient, K/V expanded (untimed); "
            f"plan profile {env.get('plan_profile')}"
            + ("; rows = the same call with FLASH_SM75_DECODE_GQA=prefill (the group's q-heads "
               "as query rows of the prefill kernels), ours/rows = its speed-up, rows paged = "
               "its paged call" if args.group_rows else ""))
    C.write_table_bench(args, env, "bench_decode.py", head,
                        ["case", "h/hk", "B", "cache", "ours ms", "KV GB/s", "% copy", "op ms",
                         "op % copy", "paged ms", "paged/ours", "eff ms", "eff/ours"]
                        + (["rows ms", "rows % copy", "ours/rows", "rows paged ms"]
                           if args.group_rows else []),
                        rows, records)
    plot(records, os.path.join(args.out_dir, args.tag + ".png"),
         f"decode KV bandwidth, {(env.get('gpu') or {}).get('name')}, plan "
         f"{env.get('plan_profile')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
