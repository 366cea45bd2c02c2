#!/usr/bin/env python3
"""Build the "mem-efficient as a T4 runs it" baseline: torch's memory-efficient attention kernels
instantiated for cutlass::arch::Sm75 (fp16) as a library of torch ops.

    python scripts/build_memeff_sm75.py [--out .peer/memeff_sm75] [--jobs 2]

What a T4 runs when torch's SDPA picks its mem-efficient backend are the Sm75 instantiations of
the cutlass kernels torch ships as headers (ATen/native/transformers/cuda/mem_eff_attention/);
an H200 runs their sm80 instantiations instead. This builds our wrapper
(``benchmarks/baselines/memeff_sm75.cu``: the Sm75 fp16 kernels torch's dispatch picks on a 64
KiB SM, under our own kernel names, and torch's launcher logic) against the torch in use and
cutlass headers (torch's wheel ships none) at the commit torch pins, for ``compute_75`` PTX and
``sm_75`` SASS, so a newer GPU JIT-compiles exactly what a T4 runs, as our own build is measured.

Cutlass: ``--cutlass-dir`` (a directory holding ``include/cutlass``), else the headers of
``--cutlass-commit`` (default: torch 2.11's pin, v4.3.2) extracted from the git mirror
``--cutlass-git-dir`` into ``--work-dir`` (default ``build/memeff_sm75``, git-ignored).

Output in ``--out`` (default ``.peer/memeff_sm75``, git-ignored; no torch or cutlass code or
binary is ever committed): ``memeff_sm75.so`` (registers ``torch.ops.memeff_sm75.*``, no
pybind: it loads with ``torch.ops.load_library`` under any CPython, with the torch it was built
against) and ``BASELINE_INFO.json`` (torch, cutlass commit, arch, the kernels per head dim and
pass, build command), which ``benchmarks/_memeff_sm75.py`` reads and the benchmarks record. The
script loads the library on the CPU to read the kernel plan, and checks with ``cuobjdump`` that
every built kernel's compute_75 PTX holds its body (``mma.sync``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _memeff_sm75 as baseline  # noqa: E402

SOURCE = ROOT / "benchmarks" / "baselines" / "memeff_sm75.cu"
# The cutlass commit torch 2.11 pins (third_party/cutlass): v4.3.2, set by pytorch PR #169865
# (merged 2025-12-30); the next bump (4.4.1, PR #176803) landed in March 2026, after the 2.11
# branch cut.
TORCH_2_11_CUTLASS = "5c149f52a436782210263fb2f19b354443a61c6a"
CUTLASS_MIRROR = Path("/work/.mirror/NVIDIA+cutlass/repo")
GENCODE = "arch=compute_75,code=[sm_75,compute_75]"
# Kept for the report: the head dims the plan is written for.
PLAN_HEAD_DIMS = (40, 64, 80, 96, 128, 256)


def cutlass_version(include: Path) -> str | None:
    text = (include / "cutlass" / "version.h").read_text(errors="replace")
    parts = [re.search(rf"#define CUTLASS_{k} (\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else None


def extract_cutlass(git_dir: Path, commit: str, work: Path) -> Path:
    """include/ of cutlass at `commit`, extracted once from a (bare) git repository."""
    dest = work / f"cutlass-{commit}"
    if (dest / "include" / "cutlass" / "version.h").is_file():
        return dest
    if not git_dir.exists():
        raise SystemExit(f"build_memeff_sm75: no cutlass git mirror at {git_dir}; pass "
                         f"--cutlass-dir (a checkout at {commit}) or --cutlass-git-dir")
    have = subprocess.run(["git", "--git-dir", str(git_dir), "cat-file", "-e", f"{commit}^{{commit}}"],
                          capture_output=True)
    if have.returncode != 0:
        raise SystemExit(f"build_memeff_sm75: commit {commit} is not in {git_dir} (fetch it, or "
                         f"pass --cutlass-dir)")
    tmp = Path(tempfile.mkdtemp(dir=work, prefix="cutlass-tmp-"))
    try:
        archive = subprocess.run(["git", "--git-dir", str(git_dir), "archive", commit, "include"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dest


def find_cuobjdump(nvcc: Path) -> str | None:
    """cuobjdump of the toolkit, else the one triton bundles (some toolkits lack it)."""
    for cand in (nvcc.parent / "cuobjdump",):
        if cand.is_file():
            return str(cand)
    if shutil.which("cuobjdump"):
        return shutil.which("cuobjdump")
    try:
        import triton  # noqa: F401
        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        return str(bundled) if bundled.is_file() else None
    except Exception:
        return None


def ptx_report(cuobjdump: str, so: Path) -> dict:
    """Per kernel of ours in the library's PTX: its target and instruction counts."""
    ptx = subprocess.run([cuobjdump, "-ptx", str(so)], capture_output=True, text=True,
                         check=True).stdout
    out = {}
    for unit in re.split(r"(?m)^\.version ", ptx)[1:]:
        target = re.search(r"(?m)^\.target (\S+)", unit)
        for entry in re.split(r"(?m)^\.visible \.entry ", unit)[1:]:
            m = re.search(r"memeff_sm75_(fwd|bwd)_\w+?(?=EN)", entry)
            if not m:
                continue
            out[m.group(0)] = {"target": target.group(1) if target else None,
                               "lines": entry.count("\n"),
                               "mma_sync": entry.count("mma.sync"),
                               "ldmatrix": entry.count("ldmatrix")}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=baseline.DEFAULT_DIR, help="where the build goes")
    ap.add_argument("--cutlass-dir", type=Path, default=None,
                    help="a cutlass tree (with include/cutlass) to use as is")
    ap.add_argument("--cutlass-commit", default=TORCH_2_11_CUTLASS,
                    help="the cutlass commit (default: torch 2.11's pin, v4.3.2); with "
                         "--cutlass-dir, what to record for it")
    ap.add_argument("--cutlass-git-dir", type=Path, default=CUTLASS_MIRROR,
                    help="git repository of NVIDIA/cutlass to extract --cutlass-commit from")
    ap.add_argument("--work-dir", type=Path, default=ROOT / "build" / "memeff_sm75",
                    help="objects and extracted headers (git-ignored)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="compile the forward and backward units in parallel (2) or one after "
                         "the other (1)")
    ap.add_argument("--nvcc", type=Path, default=None, help="default $CUDA_HOME/bin/nvcc")
    ap.add_argument("--no-strip", action="store_true", help="keep the library's symbols")
    ap.add_argument("--no-ptx-check", action="store_true",
                    help="skip the cuobjdump check that the PTX holds the kernel bodies")
    a = ap.parse_args(argv)
    if a.jobs < 1:
        ap.error("--jobs must be >= 1")

    import torch
    import torch.utils.cpp_extension as cpp

    t0 = time.time()
    if a.cutlass_dir is not None and not (a.cutlass_dir / "include/cutlass/version.h").is_file():
        ap.error(f"--cutlass-dir {a.cutlass_dir} has no include/cutlass/version.h")
    nvcc = a.nvcc or Path(cpp.CUDA_HOME or "/usr/local/cuda") / "bin" / "nvcc"
    if not nvcc.is_file():
        ap.error(f"no nvcc at {nvcc} (set CUDA_HOME or --nvcc)")
    if torch.version.cuda is None:
        ap.error("this torch has no CUDA")
    work = a.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    if a.cutlass_dir is not None:
        cutlass = a.cutlass_dir.resolve()
        cutlass_source = f"--cutlass-dir {cutlass}"
    else:
        cutlass = extract_cutlass(a.cutlass_git_dir, a.cutlass_commit, work)
        cutlass_source = f"git archive {a.cutlass_commit} of {a.cutlass_git_dir}"

    cxx = os.environ.get("CXX") or ("/usr/bin/g++" if Path("/usr/bin/g++").exists() else "g++")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp.include_paths("cuda")] + [f"-I{cutlass / 'include'}"]
    nvcc_flags = ["-std=c++17", "-O3", "-DNDEBUG", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                  *cpp.COMMON_NVCC_FLAGS, "--expt-extended-lambda", "-Xcompiler", "-fPIC",
                  "-gencode", GENCODE, "-ccbin", cxx]
    units = [(1, work / "memeff_sm75_fwd.o"), (2, work / "memeff_sm75_bwd.o")]
    compile_cmds = [[str(nvcc), "-c", str(SOURCE), "-o", str(obj), f"-DMEMEFF_SM75_PART={part}",
                     *includes, *nvcc_flags] for part, obj in units]
    for cmd in compile_cmds:
        print("+", shlex.join(cmd), flush=True)
    t_compile = time.time()
    if a.jobs >= 2:
        procs = [subprocess.Popen(cmd) for cmd in compile_cmds]
        codes = [p.wait() for p in procs]
    else:
        codes = [subprocess.run(cmd).returncode for cmd in compile_cmds]
    if any(codes):
        print(f"build_memeff_sm75: nvcc failed ({codes})", file=sys.stderr)
        return 1
    t_compile = time.time() - t_compile

    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    so = out / baseline.LIBRARY
    lib_dirs = cpp.library_paths("cuda")
    link_cmd = [cxx, "-shared", "-o", str(so), *(str(o) for _, o in units),
                *(f"-L{d}" for d in lib_dirs),
                "-lc10", "-lc10_cuda", "-ltorch_cpu", "-ltorch_cuda", "-ltorch", "-lcudart"]
    print("+", shlex.join(link_cmd), flush=True)
    subprocess.run(link_cmd, check=True)
    if not a.no_strip and shutil.which("strip"):
        subprocess.run(["strip", "--strip-unneeded", str(so)], check=True)

    # Load it (no GPU needed) for the plan and the candidate table: also proves it links.
    probe = ("import json, sys, torch; torch.ops.load_library(sys.argv[1]); "
             "m = torch.ops.memeff_sm75; "
             f"print(json.dumps({{'plan': {{d: m.plan(d) for d in {list(PLAN_HEAD_DIMS)}}}, "
             "'kernels': m.kernels()}))")
    r = subprocess.run([sys.executable, "-c", probe, str(so)], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"build_memeff_sm75: the library does not load:\n{r.stderr[-3000:]}",
              file=sys.stderr)
        return 1
    loaded = json.loads(r.stdout.strip().splitlines()[-1])
    plan = {str(d): {"forward": f, "backward": b} for d, (f, b) in loaded["plan"].items()}
    candidates = []
    for row in loaded["kernels"]:
        name, pas, built, smem, threads = row.split()
        candidates.append({"name": name, "pass": pas, "built": built == "built",
                           "smem_bytes": int(smem), "threads": int(threads)})

    ptx = None
    if not a.no_ptx_check:
        tool = find_cuobjdump(nvcc)
        if tool is None:
            print("build_memeff_sm75: no cuobjdump found; pass --no-ptx-check to skip the check",
                  file=sys.stderr)
            return 1
        ptx = ptx_report(tool, so)
        built = sum(c["built"] for c in candidates)
        empty = [k for k, v in ptx.items() if v["mma_sync"] == 0 or v["target"] != "sm_75"]
        if len(ptx) != built or empty:
            print(f"build_memeff_sm75: PTX check failed: {len(ptx)} kernels in the PTX for "
                  f"{built} built; without a body (no mma.sync) or not .target sm_75: {empty}",
                  file=sys.stderr)
            return 1

    info = {
        "what": "torch's memory-efficient attention kernels (cutlass, mem_eff_attention headers) "
                "instantiated for cutlass::arch::Sm75, fp16, chosen as torch does on a 64 KiB "
                "Turing SM; benchmarks/baselines/memeff_sm75.cu",
        "torch": torch.__version__,
        "torch_git_version": getattr(torch.version, "git_version", None),
        "torch_cuda": torch.version.cuda,
        "nvcc": subprocess.run([str(nvcc), "--version"], capture_output=True,
                               text=True).stdout.strip().splitlines()[-1],
        "cutlass_commit": a.cutlass_commit,
        "cutlass_version": cutlass_version(cutlass / "include"),
        "cutlass_source": cutlass_source,
        "arch_list": "compute_75 PTX + sm_75 SASS (-gencode " + GENCODE + ")",
        "smem_limit_bytes": 64 * 1024,
        "kernels_per_head_dim": plan,
        "candidates": candidates,
        "ptx": ptx,
        "library": so.name,
        "library_bytes": so.stat().st_size,
        "build_commands": [shlex.join(c) for c in compile_cmds] + [shlex.join(link_cmd)],
        "build_s": round(time.time() - t0, 1),
        "compile_s": round(t_compile, 1),
        "jobs": a.jobs,
        "built_by": shlex.join([Path(sys.executable).name, *sys.argv]),
    }
    (out / baseline.INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    print(f"build_memeff_sm75: {so} ({so.stat().st_size / 2**20:.2f} MiB), "
          f"{out / baseline.INFO_FILE}; {info['build_s']} s (compile {info['compile_s']} s, "
          f"{a.jobs} job(s))")
    for d, p in plan.items():
        print(f"  d={d}: forward {p['forward']}, backward {p['backward']}")
    # The device tool carries at most 64 MiB: the whole .peer folder and our extension.
    ext = ROOT / "flash_attention_sm75" / "_C.abi3.so"
    peer = ROOT / ".peer"
    total = sum(f.stat().st_size for f in peer.rglob("*") if f.is_file()) if peer.is_dir() else 0
    total += ext.stat().st_size if ext.is_file() else 0
    print(f"  .peer + flash_attention_sm75/_C.abi3.so: {total / 2**20:.1f} MiB "
          f"({'within' if total <= 64 * 2**20 else 'OVER'} the 64 MiB a GPU run carries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
