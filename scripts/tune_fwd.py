"""Time forward-kernel tile variants side by side (development tool, needs a CUDA GPU).

Builds one extension with one translation unit per (head_dim, Br, Bc, warps) variant, compiled
for sm_75 (+PTX) in parallel, then times each variant and SDPA mem-efficient on the same inputs.
Usage: python scripts/tune_fwd.py [--n 4096 8192] [--variants 128,128,64,8 128,64,32,4,1,3]
A variant is d,Br,Bc,warps[,q_in_smem(0/1)[,min_blocks_per_sm[,rescale_thr[,load_style(0-2)
[,split_tile(0/1)]]]]] (the Flash_fwd_kernel_traits parameters), e.g. 128,128,64,8,0,1,8 for the
threshold rescale, 128,128,64,8,0,1,8,0,1 for the d=128 default.
"""
import argparse
import os
import pathlib
import tempfile

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.cpp_extension import load

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _common  # noqa: E402  (benchmarks/_common.py: timing helpers)

TU = """
#include "flash_api.h"
#include "kernels/flash_fwd_launch_template.h"
namespace flash_sm75 {{
void run_variant_{i}(Flash_fwd_params& p, cudaStream_t s) {{
  using Kt = Flash_fwd_kernel_traits<{d}, {bm}, {bn}, {w}, {qs}, {mb}, {thr}, {ls}, {sp}>;
  if (p.is_causal) run_flash_fwd<Kt, true>(p, s); else run_flash_fwd<Kt, false>(p, s);
}}
}}
"""

BIND = """
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include "flash_api.h"
namespace flash_sm75 {{ {decls} }}
using namespace flash_sm75;
at::Tensor run(at::Tensor q, at::Tensor k, at::Tensor v, bool causal, int64_t variant) {{
  auto out = at::empty({{q.size(0), q.size(1), q.size(2), q.size(3)}}, q.options());
  auto lse = at::empty({{q.size(0), q.size(2), q.size(1)}}, q.options().dtype(at::kFloat));
  Flash_fwd_params p;
  set_params_fprop(p, q, k, v, out, lse, 1.0 / std::sqrt((double)q.size(3)), causal, true,
                   std::nullopt, std::nullopt);
  auto s = at::cuda::getCurrentCUDAStream().stream();
  switch (variant) {{ {cases} }}
  return out;
}}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{ m.def("run", &run); }}
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--variants", nargs="+",
                    # the tiles in use (Fwd_tile_config): d=64 default and small-grid, d=128
                    # split tile
                    default=["64,64,64,4,0,3,0,2", "64,64,32,4,1,4", "128,128,64,8,0,1,8,0,1"])
    args = ap.parse_args()
    variants = [tuple(int(x) for x in v.split(",")) for v in args.variants]
    variants = [v + (0, 1, 0, 0, 0)[len(v) - 4:] for v in variants]
    tmp = pathlib.Path(tempfile.mkdtemp())
    srcs = []
    for i, (d, bm, bn, w, qs, mb, thr, ls, sp) in enumerate(variants):
        f = tmp / f"v{i}.cu"
        f.write_text(TU.format(i=i, d=d, bm=bm, bn=bn, w=w, qs="true" if qs else "false", mb=mb,
                               thr=thr, ls=ls, sp="true" if sp else "false"))
        srcs.append(str(f))
    decls = " ".join(f"void run_variant_{i}(Flash_fwd_params&, cudaStream_t);" for i in range(len(variants)))
    cases = " ".join(f"case {i}: run_variant_{i}(p, s); break;" for i in range(len(variants)))
    (tmp / "bind.cpp").write_text(BIND.format(decls=decls, cases=cases))
    srcs += [str(tmp / "bind.cpp"), str(ROOT / "csrc/flash_api.cpp"),
             str(ROOT / "csrc/kernels/flash_fwd_dispatch.cpp")]
    srcs += sorted(str(p) for p in (ROOT / "csrc/kernels/instantiations").glob("flash_fwd_*.cu"))
    os.environ["TORCH_CUDA_ARCH_LIST"] = "7.5+PTX"
    mod = load("fa_sm75_tune", srcs, extra_include_paths=[str(ROOT / "csrc")],
               extra_cuda_cflags=["-O3", "--use_fast_math", "-std=c++17", "-Xptxas=-warn-spills"],
               build_directory=str(tmp), verbose=False)

    def bench(fn):
        # Back-to-back calls between two events, so host-side launch cost overlaps the GPU
        # work (it would dominate single-call timings of the ~30 us N=512 cases).
        return _common.bench_launch_loop(fn, "cuda", calls=20, trials=7)

    B, H = 4, 16
    for n in args.n:
        for causal in (False, True):
            for d in sorted({v[0] for v in variants}):
                q = torch.randn(B, H, n, d, device="cuda", dtype=torch.half)
                k, v = torch.randn_like(q), torch.randn_like(q)
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                    t_me = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                fl = 4 * B * H * n * n * d / (2 if causal else 1)
                row = [f"d={d} N={n} causal={int(causal)} memeff {fl / t_me / 1e9:6.1f}"]
                for i, var in enumerate(variants):
                    if var[0] != d:
                        continue
                    o = mod.run(qt, kt, vt, causal, i)
                    err = (o.transpose(1, 2).float() - ref.float()).abs().max().item()
                    t = bench(lambda: mod.run(qt, kt, vt, causal, i))
                    tag = (f"{var[1]}x{var[2]}w{var[3]}" + ("q" if var[4] else "") + f"m{var[5]}"
                           + (f"t{var[6]}" if var[6] else "") + (f"L{var[7]}" if var[7] else "")
                           + ("s" if var[8] else ""))
                    row.append(f"{tag}: {fl / t / 1e9:6.1f} ({t_me / t:.2f}x, err {err:.0e})")
                print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
