"""Time backward-kernel variants side by side, each kernel alone (development tool, needs a
CUDA GPU; ``--gen-only`` does not).

    python scripts/tune_bwd.py --d 128 --n 4096 8192 --dkdv default 32,64,8 --dq default 32,8
    cp -r csrc/kernels /tmp/v1 && rm -r /tmp/v1/instantiations   # then edit /tmp/v1/*.h
    python scripts/tune_bwd.py --n 4096 --causal 0 --dkdv default /tmp/v1:default 64/default

A variant is ``[d/][DIR:]SPEC``. DIR (default: csrc/kernels) may name a copy of csrc/kernels,
relative to the repository root or absolute: it is compiled with the kernels' namespace renamed
by a macro in its translation unit, so every variant's template instantiations are distinct
symbols in one extension module and a source edit can be timed against the original in one
build. d (64 or 128) defaults to --d. SPEC of a dK/dV variant (flash_bwd_dkdv_kernel without
atomic dQ, the 8-warp kernel; the plain deterministic calls at d = 64 and 128 run the
K-in-registers kernel instead, which this script does not time): ``Br,Bc,warps``
(Flash_bwd_kernel_traits) or ``default`` (Bwd_tile_config<d>::Traits); of a dQ variant: ``Bc,warps[,...]`` (Flash_bwd_dq_kernel_traits;
further numbers are passed on as its later template arguments, kDSplit, kQInSmem, kDbias,
kKVDoubleBuf: ``32,8`` is d = 128's dQ tile with one K / V buffer, ``32,8,1,0,1,1`` the
double-buffered one that ships) or ``default`` (Bwd_tile_config<d>::DqTraits).

The problem is prepared with the library's host code (prepare_bwd) and the real preprocess
kernel. Each variant first runs once on NaN-poisoned gradients and is compared with the
library's backward op: "bitwise", or "DIFF" with the max error (the library's own kernel choice
may sum in another order). Then the variants of one shape are timed in alternating rounds
(10 back-to-back launches between CUDA events, median of 5 trials per round; printed: the
median over rounds, and every round). TFLOP/s use the kernel's own matmul work: 4 units of
2*N^2*d per head for dK/dV, 3 for dQ (halved when causal). benchmarks/NOTES.md records uses.
"""
import argparse
import itertools
import json
import os
import pathlib
import statistics
import sys
import tempfile

import torch
from torch.utils.cpp_extension import load

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _common  # noqa: E402  (benchmarks/_common.py: timing helpers)

TU = """
{pre}
#include "{kdir}/flash_bwd_kernel.h"
{post}
#include "flash_api.h"
#include "kernels/launch_utils.h"
#include "kernels/flash_bwd.h"
namespace flash_sm75 {{
void run_{kind}_{i}(Flash_bwd_params& p, cudaStream_t s) {{
  using Kr = {ns}::{traits};
  auto kernel = p.is_causal ? &{ns}::{kern}<Kr, true{kx}> : &{ns}::{kern}<Kr, false{kx}>;
  const int smem = Kr::{smem};
  set_max_dynamic_smem(kernel, smem);
  const int nblk = {grid};
  kernel<<<nblk, Kr::kNThreads, smem, s>>>(reinterpret_cast<{ns}::Flash_bwd_params&>(p));
}}
}}
"""
PRE = """
#include "flash_api.h"
#include "kernels/flash_bwd_launch_template.h"
namespace flash_sm75 {{
void preprocess(Flash_bwd_params& p, cudaStream_t s) {{
  const int64_t rows = static_cast<int64_t>(p.b) * p.h * p.seqlen_q;
  const int per_block = kBwdAuxThreads / (p.d / 8);
  if (p.d == 64)
    flash_bwd_preprocess_kernel<64><<<(rows + per_block - 1) / per_block, kBwdAuxThreads, 0, s>>>(p);
  else
    flash_bwd_preprocess_kernel<128><<<(rows + per_block - 1) / per_block, kBwdAuxThreads, 0, s>>>(p);
}}
}}
"""
BIND = """
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include "flash_api.h"
#include "kernels/flash_bwd.h"
namespace flash_sm75 {{ {decls} void preprocess(Flash_bwd_params&, cudaStream_t); }}
using namespace flash_sm75;
static Flash_bwd_params g_params;
static BwdBuffers g_bufs;
static at::Tensor g_keep[6];
void setup(at::Tensor dout, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor out,
           at::Tensor lse, double scale, bool causal) {{
  g_keep[0] = dout; g_keep[1] = q; g_keep[2] = k; g_keep[3] = v; g_keep[4] = out; g_keep[5] = lse;
  g_params = Flash_bwd_params{{}};
  g_bufs = prepare_bwd(g_params, dout, q, k, v, out, lse, scale, causal, true, std::nullopt,
                       std::nullopt, false, std::nullopt);
  preprocess(g_params, at::cuda::getCurrentCUDAStream().stream());
}}
void run(int64_t i) {{
  auto s = at::cuda::getCurrentCUDAStream().stream();
  switch (i) {{ {cases} }}
}}
std::vector<at::Tensor> grads() {{ return {{g_bufs.dq, g_bufs.dk, g_bufs.dv}}; }}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{
  m.def("setup", &setup); m.def("run", &run); m.def("grads", &grads);
}}
"""


def parse_spec(kind, spec, default_d):
    """'[d/][DIR:]SPEC' -> (d, DIR or 'base', traits type, kernel template, extra template
    arguments, shared-memory constant, grid expression). Raises ValueError on a malformed spec."""
    d, rest = (spec.split("/", 1) if spec[:1].isdigit() and "/" in spec else (default_d, spec))
    vdir, sp = rest.rsplit(":", 1) if ":" in rest else ("base", rest)
    d = int(d)
    key_grid = "((p.seqlen_k + Kr::kBlockN - 1) / Kr::kBlockN) * p.b * p.h_k"
    q_grid = "((p.seqlen_q + Kr::kBlockM - 1) / Kr::kBlockM) * p.b * p.h"
    if kind == "dkdv" and sp == "default":
        return (d, vdir, f"Bwd_tile_config<{d}>::Traits", "flash_bwd_dkdv_kernel", ", false",
                "kSmemSizeNoDq", key_grid)
    if sp == "default":
        return (d, vdir, f"Bwd_tile_config<{d}>::DqTraits", "flash_bwd_dq_kernel", "",
                "kSmemSize", q_grid)
    nums = [int(x) for x in sp.split(",")]
    if kind == "dkdv":
        if len(nums) != 3:
            raise ValueError(f"dK/dV spec {spec!r}: Br,Bc,warps or default")
        br, bc, w = nums
        return (d, vdir, f"Flash_bwd_kernel_traits<{d}, {br}, {bc}, {w}>", "flash_bwd_dkdv_kernel",
                ", false", "kSmemSizeNoDq", key_grid)
    if len(nums) < 2:
        raise ValueError(f"dQ spec {spec!r}: Bc,warps[,...] or default")
    extra = "".join(f", {x}" for x in nums[2:])
    return (d, vdir, f"Flash_bwd_dq_kernel_traits<{d}, {nums[0]}, {nums[1]}{extra}>",
            "flash_bwd_dq_kernel", "", "kSmemSize", q_grid)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=128, choices=[64, 128],
                    help="head dim of variants without a d/ prefix (default 128)")
    ap.add_argument("--n", type=int, nargs="+", default=[4096], help="seqlen_q = seqlen_k")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1], choices=[0, 1])
    ap.add_argument("--rounds", type=int, default=3, help="alternating timing rounds")
    ap.add_argument("--dkdv", nargs="*", default=[], help="dK/dV variants ([d/][DIR:]SPEC)")
    ap.add_argument("--dq", nargs="*", default=[], help="dQ variants ([d/][DIR:]SPEC)")
    ap.add_argument("--json", help="also write every timing to this JSON file")
    ap.add_argument("--gen-only", action="store_true",
                    help="write the generated sources, print their directory, stop (no GPU)")
    a = ap.parse_args()
    if not a.dkdv and not a.dq:
        ap.error("give at least one variant with --dkdv or --dq")
    tmp = pathlib.Path(tempfile.mkdtemp())
    variants, srcs, decls, cases = [], [], [], []
    for kind, specs in (("dkdv", a.dkdv), ("dq", a.dq)):
        for spec in specs:
            i = len(variants)
            try:
                d, vdir, traits, kern, kx, smem, grid = parse_spec(kind, spec, a.d)
            except ValueError as e:
                ap.error(str(e))
            kdir = ROOT / "csrc/kernels" if vdir == "base" else (ROOT / vdir).resolve()
            if not (kdir / "flash_bwd_kernel.h").is_file():
                ap.error(f"{spec!r}: {kdir} holds no flash_bwd_kernel.h (a copy of csrc/kernels?)")
            ns = "flash_sm75" if vdir == "base" else f"flash_sm75_v{i}"
            pre = "" if vdir == "base" else f"#define flash_sm75 {ns}"
            post = "" if vdir == "base" else "#undef flash_sm75"
            f = tmp / f"v{i}.cu"
            f.write_text(TU.format(pre=pre, post=post, kdir=kdir, kind=kind, i=i, ns=ns,
                                   traits=traits, kern=kern, grid=grid, kx=kx, smem=smem))
            srcs.append(str(f))
            decls.append(f"void run_{kind}_{i}(Flash_bwd_params&, cudaStream_t);")
            cases.append(f"case {i}: run_{kind}_{i}(g_params, s); break;")
            variants.append((kind, spec, d))
    (tmp / "pre.cu").write_text(PRE.format())
    srcs.append(str(tmp / "pre.cu"))
    (tmp / "bind.cpp").write_text(BIND.format(decls=" ".join(decls), cases=" ".join(cases)))
    srcs += [str(tmp / "bind.cpp"), str(ROOT / "csrc/flash_api.cpp"),
             str(ROOT / "csrc/flash_bwd_api.cpp"), str(ROOT / "csrc/kernels/flash_fwd_dispatch.cpp"),
             str(ROOT / "csrc/kernels/flash_bwd_dispatch.cpp")]
    srcs += sorted(str(p) for p in (ROOT / "csrc/kernels/instantiations").glob("*.cu"))
    if a.gen_only:
        print(tmp)
        return
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "7.5+PTX")
    mod = load("fa_sm75_tune_bwd", srcs, extra_include_paths=[str(ROOT / "csrc")],
               extra_cuda_cflags=["-O3", "--use_fast_math", "-std=c++17", "-Xptxas=-warn-spills"],
               build_directory=str(tmp), verbose=False)
    B, H = a.batch, a.heads
    records = []
    for d, n, causal in itertools.product(sorted({v[2] for v in variants}), a.n, a.causal):
        causal = bool(causal)
        pb = _common.bwd_problem(B, H, n, d, causal)  # inputs, forward, reference gradients
        ref = pb["ref"]
        mod.setup(pb["dout"], pb["q"], pb["k"], pb["v"], pb["out"], pb["lse"], pb["scale"], causal)
        unit = 2.0 * B * H * n * n * d / (2 if causal else 1)
        sel = [i for i, v in enumerate(variants) if v[2] == d]
        check, times = {}, {i: [] for i in sel}
        for i in sel:
            for gr in mod.grads():
                gr.fill_(float("nan"))
            mod.run(i)
            torch.cuda.synchronize()
            dq, dk, dv = mod.grads()
            got, want = ((dk, dv), ref[1:]) if variants[i][0] == "dkdv" else ((dq,), ref[:1])
            err = max((x.float() - y.float()).abs().max().item() for x, y in zip(got, want))
            same = all(torch.equal(x, y) for x, y in zip(got, want))
            check[i] = ("bitwise", 0.0) if same else (f"DIFF err {err:.1e}", err)
        for _ in range(a.rounds):
            for i in sel:
                times[i].append(_common.bench_launch_loop(lambda: mod.run(i), "cuda", calls=10,
                                                          trials=5))
        for i in sel:
            kind, spec, _ = variants[i]
            t = statistics.median(times[i])
            tf = (4 if kind == "dkdv" else 3) * unit / t / 1e9
            rounds = " ".join(f"{x:.3f}" for x in times[i])
            print(f"d={d} N={n} causal={int(causal)} {kind:4s} {spec:28s} {t:8.3f} ms {tf:5.0f} TF"
                  f"  [{rounds}] {check[i][0]}", flush=True)
            records.append(dict(d=d, n=n, causal=causal, kernel=kind, spec=spec, ms=t,
                                rounds_ms=times[i], tflops=tf, bitwise=check[i][1] == 0.0,
                                max_err=check[i][1]))
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
