"""Launch the forward op a few times for ncu (development tool), with the launches a T4 runs
(FLASH_SM75_DEVICE_PROFILE=t4 unless set) and optionally a (B, 1, N, N) bias or bool mask.

    ncu --clock-control none -k regex:flash_fwd_kernel --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python scripts/profile_fwd.py --d 128
    ncu ... --section SourceCounters python scripts/profile_fwd.py --d 128 --bias half
"""
import argparse
import os

os.environ.setdefault("FLASH_SM75_DEVICE_PROFILE", "t4")

import torch  # noqa: E402

import flash_attention_sm75  # noqa: F401,E402  (registers the ops)

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--d", type=int, default=128)
ap.add_argument("--n", type=int, default=4096)
ap.add_argument("--causal", action="store_true")
ap.add_argument("--bias", choices=("none", "half", "bool"), default="none",
                help="a (4, 1, N, N) fp16 bias or bool mask (90%% True) as attn_bias")
args = ap.parse_args()
if not torch.cuda.is_available():
    raise SystemExit("profile_fwd.py needs a CUDA GPU")
q, k, v = (torch.randn(4, args.n, 16, args.d, device="cuda", dtype=torch.half) for _ in range(3))
bias = None
if args.bias == "half":
    bias = torch.randn(4, 1, args.n, args.n, device="cuda", dtype=torch.half)
elif args.bias == "bool":
    bias = torch.rand(4, 1, args.n, args.n, device="cuda") > 0.1
for _ in range(4):
    torch.ops.flash_attention_sm75.fwd(q, k, v, args.d ** -0.5, args.causal, True, None, None,
                                       -1, -1, 0.0, None, bias)
torch.cuda.synchronize()
