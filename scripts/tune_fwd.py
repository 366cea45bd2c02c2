"""Time forward-kernel tile variants side by side (development tool, needs a CUDA GPU;
``--gen-only`` does not).

Builds one extension with one translation unit per variant, compiled for sm_75 (+PTX) in
parallel, then times each variant and SDPA mem-efficient on the same inputs.

    python scripts/tune_fwd.py [--n 4096 8192] [--variants FwdTileD128 FwdTileD128,split=0]

A variant is a tile (csrc/kernels/kernel_traits.h) written as comma-separated parts: an optional
shipped tile to start from (FwdTileD64, FwdTileD64SmallGrid, FwdTileD128; default
FwdTileDefaults, which then needs d, bm, bn and warps) and field=value overrides:

    d=kHeadDim  bm=kBlockM  bn=kBlockN  warps=kNWarps  q_in_smem=kQInSmem (0/1)
    min_blocks=kMinBlocksPerSm  rescale=kRescaleThreshold  load_style=kLoadStyle (0-2)
    split=kSplitTile (0/1)

e.g. ``d=128,bm=128,bn=64,warps=8,rescale=8`` for the threshold rescale without the split tile,
``FwdTileD128,rescale=4``. Each becomes ``struct TuneTile<i> : <base> { ...overrides }``.
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
struct TuneTile{i} : {base} {{
{fields}}};
void run_variant_{i}(Flash_fwd_params& p, cudaStream_t s) {{
  using Kt = Flash_fwd_kernel_traits<TuneTile{i}>;
  if (p.is_causal) run_flash_fwd<Kt, true, false, kFwdPlain>(p, s);
  else run_flash_fwd<Kt, false, false, kFwdPlain>(p, s);
}}
int head_dim_{i}() {{ return TuneTile{i}::kHeadDim; }}
}}
"""

# spec key -> (tile field, C++ type)
FIELDS = {"d": ("kHeadDim", "int"), "bm": ("kBlockM", "int"), "bn": ("kBlockN", "int"),
          "warps": ("kNWarps", "int"), "q_in_smem": ("kQInSmem", "bool"),
          "min_blocks": ("kMinBlocksPerSm", "int"), "rescale": ("kRescaleThreshold", "int"),
          "load_style": ("kLoadStyle", "int"), "split": ("kSplitTile", "bool")}
SHIPPED = ("FwdTileD64", "FwdTileD64SmallGrid", "FwdTileD128")


def parse_variant(spec):
    """'[BASE,]key=value,...' -> (base struct, {key: int}). Raises ValueError on a bad spec."""
    parts = [x for x in spec.split(",") if x]
    base = "FwdTileDefaults"
    if parts and "=" not in parts[0]:
        if parts[0] not in SHIPPED:
            raise ValueError(f"variant {spec!r}: {parts[0]!r} is not one of {', '.join(SHIPPED)}")
        base = parts.pop(0)
    values = {}
    for part in parts:
        key, _, value = part.partition("=")
        if key not in FIELDS or not value.lstrip("-").isdigit():
            raise ValueError(f"variant {spec!r}: {part!r} is not key=integer with key one of "
                             f"{', '.join(FIELDS)}")
        values[key] = int(value)
    missing = [k for k in ("d", "bm", "bn", "warps") if k not in values]
    if base == "FwdTileDefaults" and missing:
        raise ValueError(f"variant {spec!r}: a tile without a base needs {', '.join(missing)}")
    return base, values


def render_variant(i, spec):
    base, values = parse_variant(spec)
    fields = "".join(
        f"  static constexpr {FIELDS[k][1]} {FIELDS[k][0]} = "
        f"{('true' if v else 'false') if FIELDS[k][1] == 'bool' else v};\n"
        for k, v in values.items())
    return TU.format(i=i, base=base, fields=fields)


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
int64_t head_dim(int64_t variant) {{
  switch (variant) {{ {dims} }}
  return 0;
}}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{ m.def("run", &run); m.def("head_dim", &head_dim); }}
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--variants", nargs="+", default=list(SHIPPED),
                    help="tile variants (see above; default: the shipped tiles)")
    ap.add_argument("--gen-only", action="store_true",
                    help="write the generated sources, print their directory, stop (no GPU)")
    args = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp())
    srcs = []
    for i, spec in enumerate(args.variants):
        f = tmp / f"v{i}.cu"
        try:
            f.write_text(render_variant(i, spec))
        except ValueError as e:
            ap.error(str(e))
        srcs.append(str(f))
    n_var = len(args.variants)
    decls = " ".join(f"void run_variant_{i}(Flash_fwd_params&, cudaStream_t); int head_dim_{i}();"
                     for i in range(n_var))
    cases = " ".join(f"case {i}: run_variant_{i}(p, s); break;" for i in range(n_var))
    dims = " ".join(f"case {i}: return head_dim_{i}();" for i in range(n_var))
    (tmp / "bind.cpp").write_text(BIND.format(decls=decls, cases=cases, dims=dims))
    if args.gen_only:
        print(tmp)
        return
    srcs += [str(tmp / "bind.cpp"), str(ROOT / "csrc/flash_api.cpp"),
             str(ROOT / "csrc/kernels/flash_fwd_dispatch.cpp")]
    srcs += sorted(str(p) for p in (ROOT / "csrc/kernels/instantiations").glob("flash_fwd_*.cu"))
    os.environ["TORCH_CUDA_ARCH_LIST"] = "7.5+PTX"
    mod = load("fa_sm75_tune", srcs, extra_include_paths=[str(ROOT / "csrc")],
               extra_cuda_cflags=["-O3", "--use_fast_math", "-std=c++17", "-Xptxas=-warn-spills"],
               build_directory=str(tmp), verbose=False)
    head_dims = [mod.head_dim(i) for i in range(n_var)]

    def bench(fn):
        # Back-to-back calls between two events, so host-side launch cost overlaps the GPU
        # work (it would dominate single-call timings of the ~30 us N=512 cases).
        return _common.bench_launch_loop(fn, "cuda", calls=20, trials=7)

    B, H = 4, 16
    for n in args.n:
        for causal in (False, True):
            for d in sorted(set(head_dims)):
                q = torch.randn(B, H, n, d, device="cuda", dtype=torch.half)
                k, v = torch.randn_like(q), torch.randn_like(q)
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                    t_me = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                fl = 4 * B * H * n * n * d / (2 if causal else 1)
                row = [f"d={d} N={n} causal={int(causal)} memeff {fl / t_me / 1e9:6.1f}"]
                for i, tag in enumerate(args.variants):
                    if head_dims[i] != d:
                        continue
                    o = mod.run(qt, kt, vt, causal, i)
                    err = (o.transpose(1, 2).float() - ref.float()).abs().max().item()
                    t = bench(lambda: mod.run(qt, kt, vt, causal, i))
                    row.append(f"{tag}: {fl / t / 1e9:6.1f} ({t_me / t:.2f}x, err {err:.0e})")
                print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
