"""Quick GPU check of the backward op: numerics against float64 autograd, then timing against
torch SDPA's memory-efficient backward (lead's dev tool).

    python scripts/smoke_bwd.py [--quick] [--dq-mode atomic|separate]

Timing: forward + backward of each implementation minus its forward alone, i.e. the backward
time; B=4, H=16, d 64/128, N 1024/4096, causal on/off. Backward FLOPs are counted as 2.5x the
forward's 4 * B * H * N^2 * d (halved when causal). Bar: ours >= 1.3x mem-efficient at d=128
N=4096 non-causal and at d=64 N=4096 causal.
"""
import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--quick", action="store_true", help="numerics only, no timing")
parser.add_argument("--dq-mode", choices=["atomic", "separate"], default=None,
                    help="sets FLASH_SM75_BWD_DQ for the non-deterministic runs")
args = parser.parse_args()
if not torch.cuda.is_available():
    sys.exit("smoke_bwd.py needs a CUDA GPU")
if args.dq_mode:
    os.environ["FLASH_SM75_BWD_DQ"] = args.dq_mode

import flash_attention_sm75  # noqa: E402,F401  (loads the ops and their autograd)

ops = torch.ops.flash_attention_sm75
dev = "cuda"
torch.manual_seed(0)
print(torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())


def ref_grads(q, k, v, do, scale, causal, br, lp=None, su=None, dtype=torch.float64):
    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    qd, kd, vd = (x.detach().to(dtype).requires_grad_(True) for x in (q, k, v))
    kk = kd.transpose(1, 2).repeat_interleave(H // Hk, 1)
    vv = vd.transpose(1, 2).repeat_interleave(H // Hk, 1)
    s = (qd.transpose(1, 2) @ kk.transpose(-1, -2)) * scale
    i = torch.arange(Sq, device=dev)[:, None]
    j = torch.arange(Sk, device=dev)[None, :]
    vis = torch.ones(B, 1, Sq, Sk, dtype=torch.bool, device=dev)
    if causal:
        vis = vis & (j <= i + (Sk - Sq if br else 0))
    if lp is not None:
        vis = vis & (j[None, None] >= lp.view(B, 1, 1, 1).long())
    if su is not None:
        vis = vis & (j[None, None] < su.view(B, 1, 1, 1).long())
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s.float() if dtype == torch.float16 else s, -1)
    p = p.masked_fill(~vis.any(-1, keepdim=True), 0).to(dtype)
    o = (p @ vv).transpose(1, 2)
    return torch.autograd.grad(o, (qd, kd, vd), do.to(dtype))


fails = 0


def check(B, Sq, Sk, H, Hk, D, causal, br, deterministic=False, lp=None, su=None):
    global fails
    q = torch.randn(B, Sq, H, D, device=dev, dtype=torch.float16)
    k = torch.randn(B, Sk, Hk, D, device=dev, dtype=torch.float16)
    v = torch.randn(B, Sk, Hk, D, device=dev, dtype=torch.float16)
    do = torch.randn(B, Sq, H, D, device=dev, dtype=torch.float16)
    scale = 1 / math.sqrt(D)
    out, lse = ops.fwd(q, k, v, scale, causal, br, lp, su)
    g = ops.bwd(do, q, k, v, out, lse, scale, causal, br, lp, su, deterministic)
    ref = ref_grads(q, k, v, do, scale, causal, br, lp, su)
    pt = ref_grads(q, k, v, do, scale, causal, br, lp, su, dtype=torch.float16)
    msg, ok = [], True
    for name, a, r, p in zip(("dq", "dk", "dv"), g, ref, pt):
        err = (a.double() - r).abs().max().item()
        err_pt = (p.double() - r).abs().max().item()
        good = err <= 2 * err_pt + 1e-3 and not torch.isnan(a).any().item()
        ok &= good
        msg.append(f"{name} {err:.2e} (pt16 {err_pt:.2e})")
    if deterministic:
        g2 = ops.bwd(do, q, k, v, out, lse, scale, causal, br, lp, su, True)
        same = all(torch.equal(a, b) for a, b in zip(g, g2))
        ok &= same
        msg.append(f"bitwise={same}")
    fails += not ok
    print(f"{'OK ' if ok else 'BAD'} B={B} Sq={Sq} Sk={Sk} H={H} Hk={Hk} D={D} causal={causal} "
          f"br={br} det={deterministic} lp={lp is not None}: " + ", ".join(msg))


for D in flash_attention_sm75._rules.HEAD_DIM_BUCKETS:
    for det in (False, True):
        for (Sq, Sk) in [(1, 1), (7, 7), (127, 129), (129, 127), (1000, 1000), (1, 1000), (1000, 7)]:
            for causal, br in [(False, True), (True, True), (True, False)]:
                check(2, Sq, Sk, 4, 2, D, causal, br, det)
        check(2, 300, 300, 8, 1, D, True, True, det)
        lp = torch.tensor([0, 5, 300], dtype=torch.int32, device=dev)
        su = torch.tensor([300, 250, 300], dtype=torch.int32, device=dev)
        check(3, 300, 300, 4, 2, D, True, False, det, lp, su)
print(f"numerics: {fails} failure(s)")
if args.quick:
    sys.exit(1 if fails else 0)


def bench(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


print("\nbackward time (ms) and TFLOP/s; B=4 H=16")
print(f"{'D':>4} {'N':>5} {'causal':>6} | {'ours':>8} {'ours det':>8} {'mem-eff':>8} | "
      f"{'TF ours':>7} {'TF det':>7} {'TF me':>7} | speedup")
B, H = 4, 16
for D in flash_attention_sm75._rules.HEAD_DIM_BUCKETS:
    for N in (1024, 4096):
        for causal in (False, True):
            q = torch.randn(B, N, H, D, device=dev, dtype=torch.float16)
            k = torch.randn(B, N, H, D, device=dev, dtype=torch.float16)
            v = torch.randn(B, N, H, D, device=dev, dtype=torch.float16)
            do = torch.randn(B, N, H, D, device=dev, dtype=torch.float16)
            out, lse = ops.fwd(q, k, v, None, causal, True)
            scale = D ** -0.5
            t_ours = bench(lambda: ops.bwd(do, q, k, v, out, lse, scale, causal, True, None, None, False))
            t_det = bench(lambda: ops.bwd(do, q, k, v, out, lse, scale, causal, True, None, None, True))
            qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v))
            dot = do.transpose(1, 2)

            def me_fwd():
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

            def me_fwd_bwd():
                o = me_fwd()
                torch.autograd.grad(o, (qt, kt, vt), dot)

            try:
                t_me = bench(me_fwd_bwd) - bench(lambda: me_fwd())
            except RuntimeError as e:  # backend unavailable
                print("mem-efficient SDPA unavailable:", e)
                t_me = float("nan")
            flops = 2.5 * 4 * B * H * N * N * D * (0.5 if causal else 1.0)
            tf = lambda t: flops / t / 1e9  # noqa: E731
            print(f"{D:>4} {N:>5} {str(causal):>6} | {t_ours:8.3f} {t_det:8.3f} {t_me:8.3f} | "
                  f"{tf(t_ours):7.1f} {tf(t_det):7.1f} {tf(t_me):7.1f} | {t_me / t_ours:5.2f}x")
sys.exit(1 if fails else 0)
