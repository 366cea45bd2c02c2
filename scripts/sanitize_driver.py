#!/usr/bin/env python3
"""Tiny driver for compute-sanitizer: launches every forward kernel instantiation
(every head-dim bucket and a head dim below each, _rules.HEAD_DIM_BUCKETS, x causal) on small, odd shapes that hit the edge paths
(partial Q/K tiles, Sq > Sk rows that see no key, decode q_len=1, GQA, strided BHSD views,
leftpad_k / seqused_k including an empty key range; at d=64 each with the small-grid tile
forced off and on, FLASH_SM75_FWD_SMALL_GRID_TILE), then the backward kernels on the same
inputs in both dQ modes (deterministic: dK/dV + dQ kernels; FLASH_SM75_BWD_DQ=atomic: dK/dV
with atomic dQ + convert), and checks each result against the ops' CPU reference
implementations.

    compute-sanitizer --tool memcheck  python3 scripts/sanitize_driver.py
    compute-sanitizer --tool racecheck python3 scripts/sanitize_driver.py
    compute-sanitizer --tool memcheck  python3 scripts/sanitize_driver.py --window 20 7

``--varlen`` runs packed sequences (the varlen ops) instead of the dense cases; ``--kvcache``
the KV-cache op (appends, decode and prefill kernels on plain and paged caches: every slot past
a sequence's length NaN, unused pages too).
``--bias`` gives every dense launch an attention bias (attn_bias): a random bool mask
(B, 1, Sq, Sk) with one query row and one key hidden entirely, or with ``--bias-float`` an fp32
(``--bias-half``: fp16) (Sq, Sk) bias with -inf entries; the backward only where it reads a bias (head_dim <= 128, no
softcap).
``--dropout P`` runs every dense launch with attention dropout (fwd_dropout; the backward with
the forward's rng_state, every head dim; d = 256 on its dropout tile): the forward's LSE (the undropped one) is checked
against the CPU reference, its output only for finiteness (tests/test_dropout.py compares it
with the mask), and the backward against the CPU reference op given the same rng_state; with
``--varlen`` the packed launches (varlen_fwd_dropout on a fixed rng_state, which the CPU
reference op draws the same mask from: output, LSE and backward all compared).
``--window LEFT RIGHT`` runs every launch with that sliding window (flash-attn's window_size);
``--softcap X`` and ``--alibi`` with those score modifiers (the score-mod instantiations; ALiBi
skips the key-range cases, which the op refuses with it).

    compute-sanitizer --tool racecheck python3 scripts/sanitize_driver.py --softcap 2 --alibi

Exit status: 0 if every launch ran and matched, 1 on a mismatch, 2 if the op/GPU is missing.
Run with PYTORCH_NO_CUDA_MEMORY_CACHING=1 so memcheck sees each tensor as its own allocation
(out-of-bounds reads inside the caching allocator's larger blocks would otherwise go unseen).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

# (name, B, Sq, Sk, H, Hk, leftpad_k or None, seqused_k or None, bhsd_view)
CASES = [
    ("odd_gqa", 2, 37, 53, 4, 2, None, None, False),
    ("decode", 3, 1, 77, 3, 1, None, None, False),
    ("sq_gt_sk", 2, 65, 33, 2, 2, None, None, False),
    ("multi_tile_bhsd", 1, 130, 191, 2, 1, None, None, True),
    ("leftpad_seqused", 3, 129, 130, 2, 1, [0, 5, 17], [130, 100, 17], False),
    ("seqused_only", 2, 17, 70, 2, 2, None, [1, 64], False),
]


def load_op():
    try:
        import flash_attention_sm75  # noqa: F401
    except Exception as e:
        print(f"sanitize_driver: import flash_attention_sm75 failed: {e}")
        return None
    try:
        return torch.ops.flash_attention_sm75.fwd
    except (AttributeError, RuntimeError):
        try:
            import flash_attention_sm75._C  # noqa: F401
            return torch.ops.flash_attention_sm75.fwd
        except Exception as e:
            print(f"sanitize_driver: op flash_attention_sm75::fwd unavailable: {e}")
            return None


def make(b, s, h, d, device, gen, bhsd):
    if bhsd:  # BHSD storage viewed as BSHD (non-contiguous batch/seq/head strides)
        x = torch.randn(b, h, s, d, generator=gen).to(torch.float16)
        return x.to(device).transpose(1, 2)
    return torch.randn(b, s, h, d, generator=gen).to(torch.float16).to(device)


def launch(tag, failures, dev, fn):
    """fn() then a device sync; on an exception record a failure and return None."""
    try:
        res = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return res
    except Exception as e:
        failures.append(f"{tag}: raised {type(e).__name__}: {e}")
        print("FAIL", failures[-1], flush=True)
        return None


def with_env(name, value, fn):
    """fn() with environment variable name set to value (restored afterwards)."""
    prev = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if prev is None:
            del os.environ[name]
        else:
            os.environ[name] = prev


def run_bwd(dout, q, k, v, out, lse, scale, causal, bottom_right, lpt, sut, mode,
            window=(-1, -1), softcap=0.0, slopes=None, bias=None, dropout=None, dbias=False):
    """The backward op in one dQ mode (the mode is read from the environment at each call);
    ``dropout``: (dropout_p, the forward's rng_state) or None; ``dbias``: ``bwd_dbias`` (the
    bias gradient too, a fourth result) when there is a bias."""
    s = scale if scale is not None else q.shape[-1] ** -0.5
    kw = {} if bias is None else {"attn_bias": bias}
    if dropout is not None:
        kw.update(dropout_p=dropout[0], rng_state=dropout[1])
    return with_env("FLASH_SM75_BWD_DQ", "atomic" if mode == "atomic" else "separate",
                    lambda: getattr(torch.ops.flash_attention_sm75,
                                    "bwd_dbias" if dbias and bias is not None else "bwd")(
                        dout, q, k, v, out, lse, s, causal, bottom_right, lpt, sut,
                        mode == "deterministic", None, *window, softcap, slopes, **kw))


def make_bias(args, b, sq, sk, dev, gen):
    """The --bias / --bias-float / --bias-half attention bias of a launch, or None."""
    if args.bias_float or args.bias_half:
        t = torch.randn(sq, sk, generator=gen)
        t = t.masked_fill(torch.rand(sq, sk, generator=gen) < 0.2, float("-inf"))
        return t.to(dev, torch.float16 if args.bias_half else torch.float32)
    if not args.bias:
        return None
    m = torch.rand(b, 1, sq, sk, generator=gen) > 0.3
    m[:, :, sq // 2] = False  # a query row that sees no key
    m[..., sk // 3] = False   # a key nobody sees
    return m.to(dev)


def grad_error(g, r):
    """max |g - r| relative to max(1, max |r|); inf for non-finite values."""
    g = g.cpu().float()
    if not bool(torch.isfinite(g).all()):
        return float("inf")
    return (g - r.float()).abs().max().item() / max(1.0, r.float().abs().max().item())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (self-test)")
    ap.add_argument("--no-check", action="store_true", help="skip the CPU reference comparison")
    from flash_attention_sm75 import _rules
    # Each bucket's instantiation at its full width and with a tail (d = bucket - 24: loads
    # zero-fill and stores skip the chunks past d, head_dims.h).
    default_d = sorted({x for b in _rules.HEAD_DIM_BUCKETS for x in (b, b - 24)})
    ap.add_argument("--d", type=int, nargs="+", default=default_d)
    ap.add_argument("--no-bwd", action="store_true", help="forward kernels only")
    ap.add_argument("--window", type=int, nargs=2, default=(-1, -1), metavar=("LEFT", "RIGHT"),
                    help="sliding window (window_size) of every launch; default -1 -1 (none)")
    ap.add_argument("--softcap", type=float, default=0.0, help="softcap of every launch (0: none)")
    ap.add_argument("--alibi", action="store_true",
                    help="ALiBi slopes (batch, heads) on every launch without key ranges")
    ap.add_argument("--bias", action="store_true",
                    help="a bool attention mask (attn_bias) on every dense launch")
    ap.add_argument("--bias-float", action="store_true",
                    help="an fp32 (Sq, Sk) attention bias with -inf entries on every dense launch")
    ap.add_argument("--bias-half", action="store_true",
                    help="an fp16 (Sq, Sk) attention bias with -inf entries on every dense launch "
                         "(the bias-only forward's other kind)")
    ap.add_argument("--dbias", action="store_true",
                    help="with --bias / --bias-float / --bias-half: the backward also computes the bias "
                         "gradient (bwd_dbias)")
    ap.add_argument("--dropout", type=float, default=0.0, metavar="P",
                    help="attention dropout probability of every dense (or, with --varlen, packed) "
                         "launch (0: none)")
    ap.add_argument("--varlen", action="store_true",
                    help="packed sequences (varlen_fwd / varlen_bwd) instead of the dense cases: "
                         "empty and one-token sequences, rows outside every sequence, seqused_k")
    ap.add_argument("--kvcache", action="store_true",
                    help="the KV-cache op (kvcache_fwd) instead of the dense cases: plain and "
                         "paged caches, q_len 1 and 5, empty and full sequences")
    args = ap.parse_args(argv)
    window = tuple(args.window)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("sanitize_driver: no CUDA device")
        return 2
    op = load_op()
    if op is None:
        return 2
    if args.dropout:
        fwd_plain = op
        states = []

        def op(q, k, v, **kw):  # fwd's keywords, with dropout; the state kept for the backward
            kw.setdefault("attn_bias", None)
            out, lse, state = torch.ops.flash_attention_sm75.fwd_dropout(
                q, k, v, args.dropout, kw.pop("softmax_scale"), kw.pop("is_causal"),
                kw.pop("causal_bottom_right"), kw.pop("leftpad_k"), kw.pop("seqused_k"),
                kw.pop("window_size_left"), kw.pop("window_size_right"), kw.pop("softcap", 0.0),
                kw.pop("alibi_slopes", None), kw.pop("attn_bias"))
            states.append(state)
            return out, lse
    dev = torch.device(args.device)
    gen = torch.Generator().manual_seed(1234)
    launches, failures = 0, []
    if args.varlen:
        launches = run_varlen(args, dev, gen, failures)
    if args.kvcache:
        launches = run_kvcache(args, dev, gen, failures)
    for d in ([] if args.varlen or args.kvcache else args.d):
        for causal in (False, True):
            for bottom_right in ((True, False) if causal else (True,)):
                # d = 64's second forward tile (small grids), forced off and on; d = 128 has
                # one tile (the switch does not apply there).
                tile_env = "FLASH_SM75_FWD_SMALL_GRID_TILE"
                tile_name = "small-grid tile"
                tiles = ("never", "always") if d == 64 else ("never",)
                for (name, b, sq, sk, h, hk, lp, su, bhsd), tile in [
                        (c, t) for c in CASES for t in tiles
                        if not (args.alibi and (c[6] is not None or c[7] is not None))]:
                    q = make(b, sq, h, d, dev, gen, bhsd)
                    k = make(b, sk, hk, d, dev, gen, bhsd)
                    v = make(b, sk, hk, d, dev, gen, bhsd)
                    lpt = None if lp is None else torch.tensor(lp, dtype=torch.int32, device=dev)
                    sut = None if su is None else torch.tensor(su, dtype=torch.int32, device=dev)
                    scale = 0.5 / (d ** 0.5) if name == "odd_gqa" else None
                    slopes = (torch.rand(b, h, generator=gen).to(dev) if args.alibi else None)
                    bias = make_bias(args, b, sq, sk, dev, gen)
                    mods = dict(softcap=args.softcap, alibi_slopes=slopes)
                    if bias is not None:
                        mods["attn_bias"] = bias
                    bwd_ok = bias is None or (d <= _rules.BIAS_BACKWARD_MAX_HEAD_DIM
                                              and not args.softcap)
                    tag = (f"d={d} causal={causal} bottom_right={bottom_right} window={window} "
                           f"softcap={args.softcap:g} alibi={args.alibi} "
                           f"bias={'none' if bias is None else bias.dtype} {name} "
                           f"B={b} Sq={sq} Sk={sk} H={h} Hk={hk}"
                           + (f" {tile_name}" if tile == "always" and sq > 1 else "")
                           + (" (decode kernel either way)" if tile == "always" and sq == 1 else ""))
                    res = launch(tag, failures, dev, lambda: with_env(
                        tile_env, tile, lambda: op(
                            q, k, v, softmax_scale=scale, is_causal=causal,
                            causal_bottom_right=bottom_right, leftpad_k=lpt, seqused_k=sut,
                            window_size_left=window[0], window_size_right=window[1], **mods)))
                    if res is None:
                        continue
                    out, lse = res
                    drop = (args.dropout, states[-1]) if args.dropout else None
                    launches += 1
                    if not args.no_bwd and tile == "never" and bwd_ok:  # no such tile there
                        dout = torch.randn(out.shape, generator=gen).to(torch.float16).to(dev)
                        for mode in ("deterministic", "atomic"):
                            grads = launch(f"{tag} bwd {mode}", failures, dev, lambda: run_bwd(
                                dout, q, k, v, out, lse, scale, causal, bottom_right, lpt, sut,
                                mode, window, args.softcap, slopes, bias, drop, args.dbias))
                            if grads is None:
                                continue
                            launches += 1
                            if args.no_check:
                                continue
                            ref = run_bwd(dout.cpu(), q.cpu(), k.cpu(), v.cpu(), out.cpu(),
                                          lse.cpu(), scale, causal, bottom_right,
                                          None if lpt is None else lpt.cpu(),
                                          None if sut is None else sut.cpu(), "deterministic",
                                          window, args.softcap,
                                          None if slopes is None else slopes.cpu(),
                                          None if bias is None else bias.cpu(),
                                          None if drop is None else (drop[0], drop[1].cpu()),
                                          args.dbias)
                            errs = [grad_error(g, r) for g, r in zip(grads, ref)]
                            ok = all(e <= 2e-2 for e in errs)
                            print(("ok  " if ok else "FAIL"), tag, f"bwd {mode}",
                                  "rel err dq/dk/dv(/dbias) " + " ".join(f"{e:.1e}" for e in errs),
                                  flush=True)
                            if not ok:
                                failures.append(f"{tag} bwd {mode}")
                    if args.no_check:
                        print("ran ", tag, flush=True)
                        continue
                    ref_op = fwd_plain if args.dropout else op
                    ro, rl = ref_op(q.cpu(), k.cpu(), v.cpu(), softmax_scale=scale,
                                is_causal=causal, causal_bottom_right=bottom_right,
                                leftpad_k=None if lpt is None else lpt.cpu(),
                                seqused_k=None if sut is None else sut.cpu(),
                                window_size_left=window[0], window_size_right=window[1],
                                softcap=args.softcap,
                                alibi_slopes=None if slopes is None else slopes.cpu(),
                                **({} if bias is None else {"attn_bias": bias.cpu()}))
                    # With dropout the LSE is the undropped one and is compared; out is not
                    # (tests/test_dropout.py checks it against the mask), the backward is.
                    o_err = 0.0 if args.dropout else (out.cpu().float() - ro.float()).abs().max().item()
                    lc, rlc = lse.cpu(), rl
                    same_inf = bool(torch.equal(torch.isinf(lc), torch.isinf(rlc)))
                    fin = torch.isfinite(rlc)
                    l_err = ((lc[fin] - rlc[fin]).abs().max().item() if fin.any() else 0.0)
                    ok = o_err <= 2e-2 and l_err <= 1e-2 and same_inf and \
                        bool(torch.isfinite(out).all())
                    print(("ok  " if ok else "FAIL"), tag,
                          f"max|out-ref|={o_err:.2e} max|lse-ref|={l_err:.2e} "
                          f"inf-pattern={'same' if same_inf else 'DIFFERENT'}", flush=True)
                    if not ok:
                        failures.append(tag)
    print(f"SANITIZE_DRIVER launches={launches} failures={len(failures)}")
    for f in failures:
        print("  failed:", f)
    return 1 if failures else 0


# Packed sequences: (lengths of q, lengths of k, seqused_k or None); rows before the first and
# after the last sequence belong to none.
VARLEN_CASES = [
    ([37, 0, 1, 70], [53, 3, 0, 70], None),
    ([65, 1, 19], [33, 80, 19], [30, 0, 100]),
]


def run_varlen(args, dev, gen, failures):
    ops = torch.ops.flash_attention_sm75
    launches = 0
    for d in args.d:
        for causal in (False, True):
            for lens_q, lens_k, used in VARLEN_CASES:
                h, hk = 4, 2
                cu_q = torch.tensor([2] + lens_q).cumsum(0).to(torch.int32)
                cu_k = torch.tensor([1] + lens_k).cumsum(0).to(torch.int32)
                q = torch.randn(int(cu_q[-1]) + 3, h, d, generator=gen).half()
                k = torch.randn(int(cu_k[-1]) + 2, hk, d, generator=gen).half()
                v = torch.randn(k.shape, generator=gen).half()
                dout = torch.randn(q.shape, generator=gen).half()
                slopes = torch.rand(len(lens_q), h, generator=gen) if args.alibi else None
                su = None if used is None else torch.tensor(used, dtype=torch.int32)
                mq, mk = max(lens_q), max(lens_k)
                tag = (f"varlen d={d} causal={causal} window={tuple(args.window)} "
                       f"softcap={args.softcap:g} alibi={args.alibi} dropout={args.dropout:g} "
                       f"lens_q={lens_q} "
                       f"lens_k={lens_k} seqused_k={used}")

                # With dropout the CPU reference draws the same mask from the same state.
                state = torch.tensor([12345 + d, 8], dtype=torch.int64)
                drop = (args.dropout, state) if args.dropout else None

                def fwd(t):
                    meta = tuple(x.to(t) for x in (q, k, v, cu_q, cu_k)) + (mq, mk)
                    rest = (None, causal, None if su is None else su.to(t), *args.window,
                            args.softcap, None if slopes is None else slopes.to(t))
                    if drop is not None:
                        return ops.varlen_fwd_dropout(*meta, drop[0], drop[1].to(t), *rest)
                    return ops.varlen_fwd(*meta, *rest)
                res = launch(tag, failures, dev, lambda: fwd(dev))
                if res is None:
                    continue
                launches += 1
                out, lse = res
                ro, rl = fwd("cpu")
                o_err = (out.cpu().float() - ro.float()).abs().max().item()
                same_inf = bool(torch.equal(torch.isinf(lse.cpu()), torch.isinf(rl)))
                fin = torch.isfinite(rl)
                l_err = (lse.cpu()[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
                ok = o_err <= 2e-2 and l_err <= 1e-2 and same_inf
                print(("ok  " if ok else "FAIL"), tag, f"max|out-ref|={o_err:.2e} "
                      f"max|lse-ref|={l_err:.2e}", flush=True)
                if not ok:
                    failures.append(tag)
                if args.no_bwd:
                    continue

                def bwd(t, o, l, mode):
                    kw = {} if drop is None else dict(dropout_p=drop[0], rng_state=drop[1].to(t))
                    return with_env(
                        "FLASH_SM75_BWD_DQ", "atomic" if mode == "atomic" else "separate",
                        lambda: ops.varlen_bwd(
                            *(x.to(t) for x in (dout, q, k, v, o, l, cu_q, cu_k)), mq, mk,
                            d ** -0.5, causal, None if su is None else su.to(t),
                            mode == "deterministic", None, *args.window, args.softcap,
                            None if slopes is None else slopes.to(t), **kw))
                ref = bwd("cpu", ro, rl, "deterministic")
                for mode in ("deterministic", "atomic"):
                    grads = launch(f"{tag} bwd {mode}", failures, dev,
                                   lambda: bwd(dev, out, lse, mode))
                    if grads is None:
                        continue
                    launches += 1
                    errs = [grad_error(g, r) for g, r in zip(grads, ref)]
                    ok = all(e <= 2e-2 for e in errs)
                    print(("ok  " if ok else "FAIL"), tag, f"bwd {mode}",
                          "rel err dq/dk/dv " + " ".join(f"{e:.1e}" for e in errs), flush=True)
                    if not ok:
                        failures.append(f"{tag} bwd {mode}")
    return launches


def run_kvcache(args, dev, gen, failures):
    """The KV-cache op on the device against its CPU implementation (the same inputs, each with
    its own copy of the caches): the appended caches equal, the outputs close. One and five
    queries run the decode kernel; 70 queries against 1280 keys the prefill kernels with key
    splits and their merge (plan_fwd_splits: 12-24 CTAs, 2 splits; none with a window under
    ~1000 keys)."""
    ops = torch.ops.flash_attention_sm75
    launches = 0
    page, b, h, hk, new = 64, 3, 4, 2, 2
    for d in args.d:
        for sq, s in ((1, 256), (5, 256), (70, 1280)):
            for causal in (False, True):
                for paged in (False, True):
                    q = torch.randn(b, sq, h, d, generator=gen).half()
                    kc = torch.randn(b, s, hk, d, generator=gen).half()
                    vc = torch.randn(b, s, hk, d, generator=gen).half()
                    k = torch.randn(b, new, hk, d, generator=gen).half()
                    v = torch.randn(b, new, hk, d, generator=gen).half()
                    lens = torch.tensor([0, 77, s - new], dtype=torch.int32)
                    for i in range(b):
                        kc[i, int(lens[i]) + new:] = float("nan")
                        vc[i, int(lens[i]) + new:] = float("nan")
                    table = None
                    if paged:
                        n = b * s // page
                        perm = torch.randperm(n + 2, generator=gen)[:n]
                        pk = torch.full((n + 2, page, hk, d), float("nan")).half()
                        pv = pk.clone()
                        pk[perm], pv[perm] = (c.reshape(n, page, hk, d) for c in (kc, vc))
                        kc, vc, table = pk, pv, perm.view(b, s // page).to(torch.int32)
                    slopes = torch.rand(b, h, generator=gen) if args.alibi else None
                    tag = (f"kvcache d={d} sq={sq} keys={s} causal={causal} paged={paged} "
                           f"window={tuple(args.window)} softcap={args.softcap:g} "
                           f"alibi={args.alibi}")

                    def fwd(t, kc_t, vc_t):
                        return ops.kvcache_fwd(
                            q.to(t), kc_t, vc_t, lens.to(t), k.to(t), v.to(t), None,
                            None if table is None else table.to(t), None, causal, *args.window,
                            args.softcap, None if slopes is None else slopes.to(t))
                    kd, vd = kc.to(dev), vc.to(dev)
                    res = launch(tag, failures, dev, lambda: fwd(dev, kd, vd))
                    if res is None:
                        continue
                    launches += 1
                    kr, vr = kc.clone(), vc.clone()
                    ro, rl = fwd("cpu", kr, vr)
                    out, lse = res
                    same_cache = (torch.equal(kd.cpu().nan_to_num(), kr.nan_to_num())
                                  and torch.equal(vd.cpu().nan_to_num(), vr.nan_to_num()))
                    # With dropout the LSE is the undropped one and is compared; out is not
                    # (tests/test_dropout.py checks it against the mask), the backward is.
                    o_err = 0.0 if args.dropout else (out.cpu().float() - ro.float()).abs().max().item()
                    same_inf = bool(torch.equal(torch.isinf(lse.cpu()), torch.isinf(rl)))
                    fin = torch.isfinite(rl)
                    l_err = (lse.cpu()[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
                    ok = same_cache and o_err <= 2e-2 and l_err <= 1e-2 and same_inf
                    print(("ok  " if ok else "FAIL"), tag, f"cache={'same' if same_cache else 'DIFF'}"
                          f" max|out-ref|={o_err:.2e} max|lse-ref|={l_err:.2e}", flush=True)
                    if not ok:
                        failures.append(tag)
    return launches


if __name__ == "__main__":
    sys.exit(main())
