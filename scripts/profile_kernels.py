"""Per-kernel GPU time of our forward + backward next to SDPA mem-efficient's (development tool).

Runs a few forward + backward steps of one shape under ``torch.profiler`` and prints, per CUDA
kernel, the total and per-call time, so a slow pass can be attributed to one kernel (e.g. the
backward's dK/dV kernel vs its separate dQ kernel vs the preprocess) before tuning it.

    python scripts/profile_kernels.py --d 128 --n 4096 [--causal] [--steps 5] [--bias bhnn]
    python scripts/profile_kernels.py --d 128 --n 1024 --dropout 0.1   # the dropout row
    python scripts/profile_kernels.py --d 128 --n 1024 --ext-probe     # extended kernels, p = 0

Needs a CUDA GPU and the built extension. No L2 flush: these are steady-state times.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

# The Turing plan, as the benchmarks (benchmarks/_common.py): the launches a T4 would run.
os.environ.setdefault("FLASH_SM75_DEVICE_PROFILE", "t4")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from flash_attention_sm75 import _rules
    ap.add_argument("--d", type=int, default=128, choices=_rules.HEAD_DIMS, metavar="D",
                    help="head_dim, a multiple of 8 from 8 to 256 (default 128)")
    ap.add_argument("--n", type=int, default=4096, help="seqlen_q = seqlen_k")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--steps", type=int, default=5, help="profiled fwd+bwd steps per backend")
    ap.add_argument("--bias", choices=("none", "bhnn", "b1nn"), default="none",
                    help="an fp16 additive bias of shape (B, H, N, N) / (B, 1, N, N), random "
                         "normal: ours through the SDPA wrapper as attn_mask (the kernels' "
                         "attn_bias), mem-efficient with the same attn_mask")
    ap.add_argument("--dropout", type=float, default=0.0, metavar="P",
                    help="attention dropout probability for both (default 0)")
    ap.add_argument("--ext-probe", action="store_true",
                    help="ours with ALiBi slopes of 0 (the same math): the extended kernels that "
                         "dropout, softcap and ALiBi run, without their work, to split a "
                         "variant's cost into the extended kernel's and its own")
    args = ap.parse_args(argv)
    if not 0.0 <= args.dropout < 1.0:
        ap.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.ext_probe and args.bias != "none":
        ap.error("--ext-probe runs without --bias")
    return args


def kernel_times(fn, steps):
    """{kernel name: (total us, calls)} over `steps` calls of fn, after two warm-up calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    acc = defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            acc[evt.name][0] += evt.device_time_total
            acc[evt.name][1] += 1
    return acc


def report(title, acc, steps):
    total = sum(t for t, _ in acc.values())
    print(f"== {title}: {total / steps / 1e3:.3f} ms per fwd+bwd step ==")
    for name, (t, calls) in sorted(acc.items(), key=lambda kv: -kv[1][0]):
        short = name if len(name) <= 90 else name[:87] + "..."
        print(f"  {t / steps / 1e3:8.3f} ms/step  {calls // steps:3d} calls/step  "
              f"{100 * t / total:5.1f}%  {short}")


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    import flash_attention_sm75 as fa

    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.batch, args.heads, args.n, args.d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.float16, generator=g)
               .requires_grad_(True) for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=torch.float16, generator=g)
    bias = None
    if args.bias != "none":
        heads = args.heads if args.bias == "bhnn" else 1
        bias = torch.randn((args.batch, heads, args.n, args.n), device="cuda",
                           dtype=torch.float16, generator=g)

    zero_slopes = torch.zeros(args.heads, device="cuda", dtype=torch.float32) \
        if args.ext_probe else None

    def ours():
        if bias is None:
            out = fa.flash_attention_forward(q, k, v, causal=args.causal,
                                             alibi_slopes=zero_slopes, dropout_p=args.dropout)
        else:
            with fa.strict():  # a fallback to torch would profile torch's kernels
                out = fa.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                                      is_causal=args.causal,
                                                      dropout_p=args.dropout)
        torch.autograd.grad(out, (q, k, v), do)

    def efficient():
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=args.causal,
                                                 dropout_p=args.dropout)
        torch.autograd.grad(out, (q, k, v), do)

    print(f"B={args.batch} H={args.heads} N={args.n} d={args.d} causal={args.causal} "
          f"bias={args.bias} dropout={args.dropout} ext_probe={args.ext_probe} "
          f"gpu={torch.cuda.get_device_name()}")
    report("ours", kernel_times(ours, args.steps), args.steps)
    report("SDPA mem-efficient", kernel_times(efficient, args.steps), args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
