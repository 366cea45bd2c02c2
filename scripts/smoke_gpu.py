"""Quick GPU smoke check of the forward op against a float64 reference (lead's dev tool)."""
import itertools
import math
import sys

import torch
import torch.nn.functional as F

import flash_attention_sm75._C  # noqa: F401

torch.manual_seed(0)
dev = "cuda"
fails = 0


def ref(q, k, v, scale, causal, bottom_right, lp=None, su=None):
    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    kd = kd.repeat_interleave(H // Hk, 1)
    vd = vd.repeat_interleave(H // Hk, 1)
    s = qd @ kd.transpose(-1, -2) * scale
    i = torch.arange(Sq, device=dev)[:, None]
    j = torch.arange(Sk, device=dev)[None, :]
    vis = torch.ones(B, 1, Sq, Sk, dtype=torch.bool, device=dev)
    if causal:
        off = Sk - Sq if bottom_right else 0
        vis = vis & (j <= i + off)
    if lp is not None:
        vis = vis & (j[None, None] >= lp.view(B, 1, 1, 1).long())
    if su is not None:
        vis = vis & (j[None, None] < su.view(B, 1, 1, 1).long())
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return (p @ vd).transpose(1, 2), lse


def check(B, Sq, Sk, H, Hk, D, causal, br, lp=None, su=None, mag=1.0, layout="bshd"):
    global fails
    if layout == "bhsd":
        q = (torch.randn(B, H, Sq, D, device=dev) * mag).half().transpose(1, 2)
        k = torch.randn(B, Hk, Sk, D, device=dev).half().transpose(1, 2)
        v = torch.randn(B, Hk, Sk, D, device=dev).half().transpose(1, 2)
    else:
        q = (torch.randn(B, Sq, H, D, device=dev) * mag).half()
        k = torch.randn(B, Sk, Hk, D, device=dev).half()
        v = torch.randn(B, Sk, Hk, D, device=dev).half()
    scale = 1 / math.sqrt(D)
    poison = torch.full((64 << 20,), float("nan"), device=dev)
    del poison
    o, lse = torch.ops.flash_attention_sm75.fwd(q, k, v, scale, causal, br, lp, su)
    o_ref, lse_ref = ref(q, k, v, scale, causal, br, lp, su)
    # PyTorch fp16 baseline error
    o_pt, _ = ref(q.half(), k, v, scale, causal, br, lp, su)
    err = (o.double() - o_ref).abs().max().item()
    fin = torch.isfinite(lse_ref)
    lerr = (lse.double() - lse_ref)[fin].abs().max().item() if fin.any() else 0.0
    lse_ok = torch.equal(torch.isfinite(lse), fin)
    nan = torch.isnan(o).any().item()
    ok = (not nan) and err < 2e-3 * max(1.0, 1.0) + 1e-3 and lerr < 1e-3 and lse_ok
    if not ok:
        fails += 1
    print(f"{'OK ' if ok else 'BAD'} B={B} Sq={Sq} Sk={Sk} H={H} Hk={Hk} D={D} causal={causal} br={br} "
          f"lp={lp is not None} mag={mag} {layout}: err={err:.2e} lse_err={lerr:.2e} nan={nan} lse_inf_ok={lse_ok}")


for D in (64, 128):
    for (Sq, Sk) in [(1, 1), (7, 7), (64, 64), (127, 129), (129, 127), (1000, 1000), (1, 1000), (1000, 7),
                     (2048, 2048), (4097, 4097), (200, 3000)]:
        for causal, br in [(False, True), (True, True), (True, False)]:
            check(2, Sq, Sk, 4, 2, D, causal, br)
    check(2, 300, 300, 8, 1, D, True, True, layout="bhsd")
    check(3, 257, 257, 8, 8, D, False, True, mag=12.0)
    lp = torch.tensor([0, 5, 100], dtype=torch.int32, device=dev)
    su = torch.tensor([300, 250, 120], dtype=torch.int32, device=dev)
    check(3, 300, 300, 4, 4, D, True, False, lp=lp, su=su)
    check(3, 1, 300, 4, 2, D, True, True, lp=lp, su=su)
    check(3, 300, 300, 4, 2, D, False, True, lp=lp, su=None)

# Timing vs SDPA mem-efficient
from torch.nn.attention import SDPBackend, sdpa_kernel

def bench(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(True), torch.cuda.Event(True)
    ts = []
    for _ in range(reps):
        st.record(); fn(); en.record(); torch.cuda.synchronize(); ts.append(st.elapsed_time(en))
    ts.sort()
    return ts[len(ts) // 2]

for D, N, causal in itertools.product((64, 128), (1024, 4096, 8192), (False, True)):
    B, H = 4, 16
    q = torch.randn(B, H, N, D, device=dev, dtype=torch.half)
    k = torch.randn_like(q); v = torch.randn_like(q)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    t_ours = bench(lambda: torch.ops.flash_attention_sm75.fwd(qt, kt, vt, None, causal, True, None, None))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        t_me = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    fl = 4 * B * H * N * N * D / (2 if causal else 1)
    print(f"D={D} N={N} causal={causal}: ours {t_ours:.3f} ms {fl/t_ours/1e9:.1f} TF/s | mem-eff {t_me:.3f} ms {fl/t_me/1e9:.1f} TF/s | ratio {t_me/t_ours:.2f}")

print("FAILS", fails)
sys.exit(1 if fails else 0)
