"""flash-attention-sm75 quickstart: run our kernel next to torch SDPA, print error and speed.

    python examples/quickstart.py [--seqlen 2048] [--head-dim 64] [--causal]

On a CUDA GPU (compute capability >= 7.5) it runs ``flash_attention_sm75``'s kernel and torch's
SDPA on the same random fp16 inputs, prints the max difference of each against a float32
reference and their times. Without a CUDA GPU it says so and shows the fallback: the drop-in
``scaled_dot_product_attention`` hands the call to torch, and the CPU build of our op is
checked against the same reference.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

# The repository root: devtools/ (not installed) and an in-place build of the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flash_attention_sm75 as fa  # noqa: E402
from devtools.cli import positive_int  # noqa: E402


def reference(q, k, v, causal):
    """float32 SDPA math on BHSD inputs (top-left causal, equal lengths here)."""
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)


def time_ms(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=positive_int, default=2)
    parser.add_argument("--heads", type=positive_int, default=16)
    parser.add_argument("--seqlen", type=positive_int, default=2048)
    parser.add_argument("--head-dim", type=int, default=64, choices=fa._rules.HEAD_DIMS, metavar="D",
                        help="a multiple of 8 from 8 to 256 (default 64)")
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)

    print(f"flash_attention_sm75 {fa.__version__}, torch {torch.__version__}, "
          f"extension built: {fa.EXTENSION_AVAILABLE}")
    if not fa.EXTENSION_AVAILABLE:
        print(f"  (the compiled op could not be loaded: {fa.EXTENSION_ERROR})")

    if not torch.cuda.is_available():
        print("No CUDA GPU found: flash_attention_sm75.scaled_dot_product_attention falls back to torch SDPA.")
        shape = (args.batch, args.heads, min(args.seqlen, 256), args.head_dim)
        q, k, v = (torch.randn(shape, dtype=torch.float16) for _ in range(3))
        reason = fa.why_not_supported(q, k, v, is_causal=args.causal)
        out = fa.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
        ref = reference(q, k, v, args.causal)
        print(f"  fallback reason: {reason}")
        print(f"  drop-in SDPA (fallback) vs float32 reference: max |diff| = {(out.float() - ref).abs().max():.2e}")
        if fa.EXTENSION_AVAILABLE:
            ours = fa.flash_attention_forward(q, k, v, causal=args.causal)  # CPU reference op
            print(f"  our op's CPU implementation vs reference:      max |diff| = {(ours.float() - ref).abs().max():.2e}")
        print("Run this on a Turing (or newer) NVIDIA GPU to use the tensor-core kernel.")
        return

    cap = torch.cuda.get_device_capability()
    print(f"GPU: {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]})")
    shape = (args.batch, args.heads, args.seqlen, args.head_dim)
    q, k, v = (torch.randn(shape, dtype=torch.float16, device="cuda") for _ in range(3))
    ref = reference(q, k, v, args.causal)
    ours = fa.flash_attention_forward(q, k, v, causal=args.causal)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
    flops = 4 * args.batch * args.heads * args.seqlen ** 2 * args.head_dim / (2 if args.causal else 1)
    t_ours = time_ms(lambda: fa.flash_attention_forward(q, k, v, causal=args.causal))
    t_sdpa = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=args.causal))
    print(f"shape (B, H, N, d) = {shape}, causal={args.causal}, fp16")
    print(f"  {'':28s} {'max |diff| vs fp32':>20s} {'ms':>8s} {'TFLOP/s':>8s}")
    print(f"  {'flash_attention_sm75':28s} {(ours.float() - ref).abs().max().item():20.2e} {t_ours:8.3f} {flops / t_ours / 1e9:8.1f}")
    print(f"  {'torch SDPA (default backend)':28s} {(sdpa.float() - ref).abs().max().item():20.2e} {t_sdpa:8.3f} {flops / t_sdpa / 1e9:8.1f}")
    print(f"  speed-up: {t_sdpa / t_ours:.2f}x")


if __name__ == "__main__":
    main()
