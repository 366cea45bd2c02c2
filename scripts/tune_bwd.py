"""Time backward-kernel variants side by side (development tool, needs a CUDA GPU).

Builds one extension with one translation unit per variant (compiled for sm_75 + PTX in
parallel), prepares one backward problem with the library's own host code (prepare_bwd), runs
the preprocess once, then times each dK/dV and dQ kernel variant alone (CUDA events around
back-to-back launches) and checks its gradients against the library's backward op.

    python scripts/tune_bwd.py --d 128 --n 4096 \\
        --dkdv old 16,4,0 16,8,0 --dq 32,8 32,4

A dK/dV variant is ``old`` (Flash_bwd_kernel_traits<d, Br, 64, 8> of Bwd_tile_config, the 8-warp
kernel without dQ) or ``Br,warps,v_in_regs[,stages]`` (Flash_bwd_dkdv_kreg_traits; stages =
query tiles per barrier, default 1);
a dQ variant is ``Bc,warps`` (Flash_bwd_dq_kernel_traits). TFLOP/s use the kernel's own matmul
work: 4 units of 2*N^2*d per head for dK/dV, 3 for dQ (halved when causal).
"""
import argparse
import json
import os
import pathlib
import tempfile

import sys

import torch
from torch.utils.cpp_extension import load

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _common  # noqa: E402  (benchmarks/_common.py: timing helpers)

DKDV_TU = """
#include "flash_api.h"
#include "kernels/flash_bwd_launch_template.h"
namespace flash_sm75 {{
void dkdv_variant_{i}(Flash_bwd_params& p, cudaStream_t s) {{
  using Kr = {traits};
  const int nb = (p.seqlen_k + Kr::kBlockN - 1) / Kr::kBlockN;
  auto kernel = p.is_causal ? {kernel_causal} : {kernel};
  set_max_dynamic_smem(kernel, {smem});
  kernel<<<nb * p.b * p.h_k, Kr::kNThreads, {smem}, s>>>(p);
}}
}}
"""

DQ_TU = """
#include "flash_api.h"
#include "kernels/flash_bwd_launch_template.h"
namespace flash_sm75 {{
void dq_variant_{i}(Flash_bwd_params& p, cudaStream_t s) {{
  using Kq = Flash_bwd_dq_kernel_traits<{d}, {bc}, {w}>;
  const int nm = (p.seqlen_q + Kq::kBlockM - 1) / Kq::kBlockM;
  auto kernel = p.is_causal ? &flash_bwd_dq_kernel<Kq, true> : &flash_bwd_dq_kernel<Kq, false>;
  set_max_dynamic_smem(kernel, Kq::kSmemSize);
  kernel<<<nm * p.b * p.h, Kq::kNThreads, Kq::kSmemSize, s>>>(p);
}}
void preprocess_{d}_{i}(Flash_bwd_params& p, cudaStream_t s) {{
  const int64_t rows = static_cast<int64_t>(p.b) * p.h * p.seqlen_q;
  const int per_block = kBwdAuxThreads / ({d} / 8);
  flash_bwd_preprocess_kernel<{d}><<<(rows + per_block - 1) / per_block, kBwdAuxThreads, 0, s>>>(p);
}}
}}
"""

BIND = """
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include "flash_api.h"
#include "kernels/flash_bwd.h"
namespace flash_sm75 {{ {decls} }}
using namespace flash_sm75;
static Flash_bwd_params g_params;
static BwdBuffers g_bufs;
static at::Tensor g_keep[6];
// Prepares the problem (inputs must be in the kernel layout) and runs the preprocess (D).
void setup(at::Tensor dout, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor out,
           at::Tensor lse, double scale, bool causal) {{
  g_keep[0] = dout; g_keep[1] = q; g_keep[2] = k; g_keep[3] = v; g_keep[4] = out; g_keep[5] = lse;
  g_params = Flash_bwd_params{{}};
  g_bufs = prepare_bwd(g_params, dout, q, k, v, out, lse, scale, causal, true, std::nullopt,
                       std::nullopt, false, std::nullopt);
  auto s = at::cuda::getCurrentCUDAStream().stream();
  preprocess_{d}_0(g_params, s);
}}
void run_dkdv(int64_t i) {{
  auto s = at::cuda::getCurrentCUDAStream().stream();
  switch (i) {{ {dkdv_cases} }}
}}
void run_dq(int64_t i) {{
  auto s = at::cuda::getCurrentCUDAStream().stream();
  switch (i) {{ {dq_cases} }}
}}
std::vector<at::Tensor> grads() {{ return {{g_bufs.dq, g_bufs.dk, g_bufs.dv}}; }}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{
  m.def("setup", &setup); m.def("run_dkdv", &run_dkdv); m.def("run_dq", &run_dq);
  m.def("grads", &grads);
}}
"""


def dkdv_source(i, d, spec):
    if spec == "old":
        traits = f"Bwd_tile_config<{d}>::Traits"
        kern = "&flash_bwd_dkdv_kernel<Kr, {c}, false>"
        smem = "Kr::kSmemSizeNoDq"
    else:
        br, w, vr, *stages = (int(x) for x in spec.split(","))
        traits = (f"Flash_bwd_dkdv_kreg_traits<{d}, {br}, {w}, {'true' if vr else 'false'}, "
                  f"{stages[0] if stages else 1}>")
        kern = "&flash_bwd_dkdv_kreg_kernel<Kr, {c}>"
        smem = "Kr::kSmemSize"
    return DKDV_TU.format(i=i, traits=traits, kernel=kern.format(c="false"),
                          kernel_causal=kern.format(c="true"), smem=smem)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=128, choices=[64, 128])
    ap.add_argument("--n", type=int, nargs="+", default=[4096])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dkdv", nargs="*", default=["old", "16,4,0"])
    ap.add_argument("--dq", nargs="*", default=["32,8"])
    ap.add_argument("--json", help="also write every timing to this JSON file")
    args = ap.parse_args()
    d = args.d
    dq_specs = args.dq or ["32,8"]  # one dQ TU also provides the preprocess launcher

    tmp = pathlib.Path(tempfile.mkdtemp())
    srcs = []
    for i, spec in enumerate(args.dkdv):
        f = tmp / f"dkdv{i}.cu"
        f.write_text(dkdv_source(i, d, spec))
        srcs.append(str(f))
    for i, spec in enumerate(dq_specs):
        bc, w = (int(x) for x in spec.split(","))
        f = tmp / f"dq{i}.cu"
        f.write_text(DQ_TU.format(i=i, d=d, bc=bc, w=w))
        srcs.append(str(f))
    decls = " ".join([f"void dkdv_variant_{i}(Flash_bwd_params&, cudaStream_t);"
                      for i in range(len(args.dkdv))]
                     + [f"void dq_variant_{i}(Flash_bwd_params&, cudaStream_t);"
                        for i in range(len(dq_specs))]
                     + [f"void preprocess_{d}_0(Flash_bwd_params&, cudaStream_t);"])
    dkdv_cases = " ".join(f"case {i}: dkdv_variant_{i}(g_params, s); break;"
                          for i in range(len(args.dkdv)))
    dq_cases = " ".join(f"case {i}: dq_variant_{i}(g_params, s); break;"
                        for i in range(len(dq_specs)))
    (tmp / "bind.cpp").write_text(BIND.format(decls=decls, d=d, dkdv_cases=dkdv_cases,
                                              dq_cases=dq_cases))
    srcs += [str(tmp / "bind.cpp"), str(ROOT / "csrc/flash_api.cpp"),
             str(ROOT / "csrc/flash_bwd_api.cpp"), str(ROOT / "csrc/kernels/flash_fwd_dispatch.cpp"),
             str(ROOT / "csrc/kernels/flash_bwd_dispatch.cpp")]
    srcs += sorted(str(p) for p in (ROOT / "csrc/kernels/instantiations").glob("*.cu"))
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "7.5+PTX")
    mod = load("fa_sm75_tune_bwd", srcs, extra_include_paths=[str(ROOT / "csrc")],
               extra_cuda_cflags=["-O3", "--use_fast_math", "-std=c++17",
                                  "-Xptxas=-warn-spills"],
               build_directory=str(tmp), verbose=False)

    import flash_attention_sm75  # noqa: F401  (the library's ops, for the reference gradients)
    B, H = args.batch, args.heads
    records = []
    for n in args.n:
        for causal in (False, True):
            g = torch.Generator(device="cpu").manual_seed(n + causal)
            q, k, v, dout = (torch.randn(B, n, H, d, generator=g).to("cuda", torch.float16)
                             for _ in range(4))
            scale = d ** -0.5
            out, lse = torch.ops.flash_attention_sm75.fwd(q, k, v, scale, causal, True)
            ref = torch.ops.flash_attention_sm75.bwd(dout, q, k, v, out, lse, scale, causal, True,
                                                     None, None, True)
            mod.setup(dout, q, k, v, out, lse, scale, causal)
            unit = 2.0 * B * H * n * n * d / (2 if causal else 1)
            row = [f"d={d} N={n} causal={int(causal)}"]
            for i, spec in enumerate(args.dkdv):
                mod.run_dkdv(i)
                torch.cuda.synchronize()
                _, dk, dv = mod.grads()
                err = max((dk.float() - ref[1].float()).abs().max().item(),
                          (dv.float() - ref[2].float()).abs().max().item())
                t = _common.bench_launch_loop(lambda: mod.run_dkdv(i), "cuda", calls=10, trials=7)
                row.append(f"dkdv[{spec}] {t:.3f} ms {4 * unit / t / 1e9:.0f} TF err {err:.0e}")
                records.append(dict(n=n, causal=causal, kernel="dkdv", spec=spec, ms=t, err=err))
            for i, spec in enumerate(dq_specs):
                mod.run_dq(i)
                torch.cuda.synchronize()
                err = (mod.grads()[0].float() - ref[0].float()).abs().max().item()
                t = _common.bench_launch_loop(lambda: mod.run_dq(i), "cuda", calls=10, trials=7)
                row.append(f"dq[{spec}] {t:.3f} ms {3 * unit / t / 1e9:.0f} TF err {err:.0e}")
                records.append(dict(n=n, causal=causal, kernel="dq", spec=spec, ms=t, err=err))
            print(" | ".join(row), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
