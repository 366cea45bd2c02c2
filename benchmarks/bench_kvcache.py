#!/usr/bin/env python3
"""flash_attn_with_kvcache with per-sequence cache lengths: chunked prefill / speculative
verification (seqlen_q > 1, causal) and ALiBi decode, the calls whose per-sequence bottom-right
alignment the kernels do themselves.

For each shape, times flash_attn_with_kvcache (the flash_attn drop-in, fa2.py) with
``cache_seqlens`` (lengths uniform in [cache/2, cache - seqlen_q], seeded) in the same run:
  * ours: the call as users make it (one KV-cache op call on the cache in place);
  * paged: the same call on the same rows as shuffled pages of 256 keys (block_table), read in
    place by the kernels;
  * 1 split: ours with FLASH_SM75_FWD_SPLITS=never (the prefill kernels' calls without key
    splits; the same as ours where the decode kernel runs or the plan takes no split);
  * eff: torch SDPA mem-efficient on the cache with K/V expanded to the q-heads beforehand
    (untimed) and a bool mask of each sequence's visible keys (its causal band).
Appends nothing to the cache (k = v = None), so repetitions are identical. The decode sweep
(one query token, bandwidth against the copy bandwidth) is bench_decode.py.

    python benchmarks/bench_kvcache.py [--batch 4] [--n 4096 16384] [--q 1 4 16 64]  (--n: cache keys)

Writes <out-dir>/<tag>.txt and .json (default bench_out/bench_kvcache.*).
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
    C.add_table_bench_args(ap, d=[128], n=[4096, 16384], tag="bench_kvcache")
    ap.add_argument("--q", type=int, nargs="+", default=[1, 4, 16, 64],
                    help="query tokens per call")
    ap.add_argument("--heads-k", type=int, default=4)
    args = ap.parse_args(argv)
    setup = C.table_bench_setup("bench_kvcache")
    if setup is None:
        return 2
    _, _, efficient, env = setup
    from flash_attention_sm75 import fa2
    rows, records = [], []
    b, h, hk = args.batch, args.heads, args.heads_k
    for d in args.d:
        for cache in args.n:
            g = torch.Generator().manual_seed(cache + d)
            kc, vc = (torch.randn(b, cache, hk, d, generator=g).to("cuda", torch.float16)
                      for _ in range(2))
            page = 256
            n = b * cache // page
            perm = torch.randperm(n, generator=g).cuda()
            pk, pv = torch.empty_like(kc).view(n, page, hk, d), torch.empty_like(vc).view(
                n, page, hk, d)
            pk[perm], pv[perm] = kc.reshape(n, page, hk, d), vc.reshape(n, page, hk, d)
            table = perm.view(b, cache // page).to(torch.int32)
            for sq in args.q:
                for mode in ("causal", "alibi"):
                    if mode == "causal" and sq == 1:
                        continue  # causal has no effect on one query row
                    q = torch.randn(b, sq, h, d, generator=g).to("cuda", torch.float16)
                    lens = torch.randint(cache // 2, cache - sq + 1, (b,), generator=g)
                    seqlens = lens.to(torch.int32).cuda()
                    slopes = (torch.rand(h, generator=g).cuda() if mode == "alibi" else None)
                    kw = dict(cache_seqlens=seqlens, causal=mode == "causal",
                              alibi_slopes=slopes)
                    with torch.no_grad():
                        ours = C.bench(lambda: fa2.flash_attn_with_kvcache(q, kc, vc, **kw),
                                       "cuda", args.warmup_ms, args.rep_ms)["ms"]
                        paged = C.bench(lambda: fa2.flash_attn_with_kvcache(
                            q, pk, pv, block_table=table, **kw), "cuda", args.warmup_ms,
                            args.rep_ms)["ms"]
                        prev = os.environ.get("FLASH_SM75_FWD_SPLITS")
                        os.environ["FLASH_SM75_FWD_SPLITS"] = "never"
                        try:
                            one = C.bench(lambda: fa2.flash_attn_with_kvcache(q, kc, vc, **kw),
                                          "cuda", args.warmup_ms, args.rep_ms)["ms"]
                        finally:
                            if prev is None:
                                os.environ.pop("FLASH_SM75_FWD_SPLITS")
                            else:
                                os.environ["FLASH_SM75_FWD_SPLITS"] = prev
                        # mem-efficient: expanded K/V, the per-sequence band as a bool mask
                        kx, vx = (t.repeat_interleave(h // hk, 2).transpose(1, 2)
                                  for t in (kc, vc))
                        i = torch.arange(sq, device="cuda").view(1, sq, 1)
                        j = torch.arange(cache, device="cuda").view(1, 1, cache)
                        end = seqlens.view(b, 1, 1).long()
                        vis = j < end
                        if mode == "causal":
                            vis = vis & (j <= i + end - sq)
                        mask = vis.unsqueeze(1)
                        if slopes is not None:
                            dist = (i + end - sq - j).abs().unsqueeze(1).float()
                            bias = (-slopes.view(1, h, 1, 1) * dist).masked_fill(~mask, -1e4)
                            mask = bias.to(torch.float16)
                        eff, _ = C.sdpa_fwd_bwd(efficient, q.transpose(1, 2), kx, vx, None,
                                                args.warmup_ms, args.rep_ms, backward=False,
                                                attn_mask=mask)
                        del kx, vx, mask
                    rec = dict(d=d, cache=cache, seqlen_q=sq, mode=mode, batch=b, heads=h,
                               heads_k=hk, lengths=lens.tolist(), ours_ms=ours,
                               paged_ms=paged, one_split_ms=one, efficient_ms=eff)
                    records.append(rec)
                    rows.append([f"d={d}", cache, sq, mode, C.fmt(ours, ".3f"),
                                 C.fmt(paged, ".3f"), C.fmt(paged / ours, ".2f"),
                                 C.fmt(one, ".3f"), C.fmt_speedup(ours, one),
                                 C.fmt(eff, ".3f"), C.fmt_speedup(ours, eff)])
                    print(rows[-1], flush=True)
    head = (f"flash_attn_with_kvcache with cache_seqlens, fp16, B={b}, H={h}, H_k={hk}, no "
            f"append; ours = one KV-cache op call in place; paged = the same rows as shuffled "
            f"pages of 256 keys (time / ours); 1 split = ours with FLASH_SM75_FWD_SPLITS=never; "
            f"eff = SDPA mem-efficient, K/V expanded (untimed), per-sequence mask; ratios = "
            f"t_other / t_ours; host time included")
    C.write_table_bench(args, env, "bench_kvcache.py", head,
                        ["case", "cache", "q", "mode", "ours ms", "paged ms", "paged/ours",
                         "1 split ms", "1 split/ours", "eff ms", "eff/ours"], rows, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
