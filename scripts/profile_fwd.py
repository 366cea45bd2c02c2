"""Launch the forward op a few times for ncu (development tool).

    ncu --clock-control none -k regex:flash_fwd_kernel --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python scripts/profile_fwd.py --d 128
"""
import argparse

import torch

import flash_attention_sm75._C  # noqa: F401  (registers the ops)

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--d", type=int, default=128)
ap.add_argument("--n", type=int, default=4096)
ap.add_argument("--causal", action="store_true")
args = ap.parse_args()
if not torch.cuda.is_available():
    raise SystemExit("profile_fwd.py needs a CUDA GPU")
q, k, v = (torch.randn(4, args.n, 16, args.d, device="cuda", dtype=torch.half) for _ in range(3))
for _ in range(4):
    torch.ops.flash_attention_sm75.fwd(q, k, v, None, args.causal, True, None, None)
torch.cuda.synchronize()
