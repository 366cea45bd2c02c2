"""Build and run the SM75 kernels on the CPU SIMT emulator (no GPU needed).

    python tests/emu/run_emu.py [quick|full|tails|decode|fwd|window|scoremod|varlen|blockinfo]

Copies csrc/kernels/*.h into a temporary directory, replaces utils.h (inline PTX) with
tests/emu/emu_utils.h (the same functions as warp collectives on cooperative fibers, see
sm75_emu.h), compiles tests/emu/test_bwd_emu.cpp with the host compiler and runs it. The
pytest test is tests/test_emu_kernels.py (quick mode). Needs g++ and the CUDA headers
(cuda_fp16.h), not a GPU.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "csrc" / "kernels"
EMU = ROOT / "tests" / "emu"


def cuda_include() -> Path | None:
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and (Path(cand) / "include" / "cuda_fp16.h").exists():
            return Path(cand) / "include"
    nvcc = shutil.which("nvcc")
    if nvcc:
        inc = Path(nvcc).resolve().parents[1] / "include"
        if (inc / "cuda_fp16.h").exists():
            return inc
    return None


def function_names(text: str) -> set[str]:
    # __device__ __forceinline__ <type> name(  -> name
    return set(re.findall(r"__device__ __forceinline__ [\w:<>\s]+?\b(\w+)\(", text))


def build(workdir: Path) -> Path:
    inc = cuda_include()
    if inc is None:
        raise RuntimeError("CUDA headers (cuda_fp16.h) not found; set CUDA_HOME")
    kdir = workdir / "kernels"
    kdir.mkdir()
    for h in KERNELS.glob("*.h"):
        shutil.copy(h, kdir / h.name)
    real = (KERNELS / "utils.h").read_text()
    shim = (EMU / "emu_utils.h").read_text()
    missing = function_names(real) - function_names(shim)
    if missing:
        raise RuntimeError(f"tests/emu/emu_utils.h lacks {sorted(missing)} from utils.h")
    shutil.copy(EMU / "emu_utils.h", kdir / "utils.h")
    exe = workdir / "test_bwd_emu"
    cmd = [os.environ.get("CXX", "g++"), "-std=c++17", "-O2", "-g0", "-w", f"-I{kdir}", f"-I{EMU}",
           f"-I{inc}", str(EMU / "test_bwd_emu.cpp"), "-o", str(exe)]
    subprocess.run(cmd, check=True)
    return exe


def run(mode: str = "quick") -> int:
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        return subprocess.run([str(exe), mode]).returncode


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", nargs="?", default="quick",
                    choices=["quick", "full", "tails", "decode", "fwd", "window", "scoremod", "varlen",
                             "blockinfo"])
    sys.exit(run(ap.parse_args().mode))
