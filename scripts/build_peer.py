#!/usr/bin/env python3
"""Build ssiu/flash-attention-turing (the SM75 peer issue 23 measures against) for the benchmarks.

    python scripts/build_peer.py --src /path/to/flash-attention-turing [--out .peer/ssiu]

``--src`` is a checkout (outside this repository, or under the ignored ``.peer/``: the peer's
code must never be committed) of https://github.com/ssiu/flash-attention-turing with its submodule
``csrc/cutlass`` at the commit the checkout pins (``git submodule update --init``, or an export
of NVIDIA/cutlass at that commit). The extension is built for ``TORCH_CUDA_ARCH_LIST=7.5+PTX``
as ours (a GPU newer than Turing JIT-compiles the compute_75 PTX) with the system compiler, into
``--out`` (default ``.peer/ssiu``, git-ignored: the peer has no licence, so its code and
binaries are never committed), next to ``PEER_INFO.json`` (its commit, cutlass's, the torch and
nvcc it was built with), which ``benchmarks/_peer.py`` reads and the benchmarks record with
their numbers. A GPU run carries ``.peer`` along; ``bench_forward.py`` / ``bench_backward.py``
with ``--backends ours,efficient,ssiu`` then time it in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _peer  # noqa: E402


def git_commit(path: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, required=True, help="the peer's checkout")
    ap.add_argument("--out", type=Path, default=_peer.DEFAULT_DIR, help="where the build goes")
    ap.add_argument("--commit", default=None,
                    help="the checkout's commit when --src is not a git work tree (an export)")
    ap.add_argument("--cutlass-commit", default=None,
                    help="cutlass's commit when csrc/cutlass is not a git work tree")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="MAX_JOBS for ninja")
    ap.add_argument("--no-strip", action="store_true",
                    help="keep the module's symbols (stripped by default: 16 -> 6 MB, so that it "
                         "and our extension fit the device tool's 64 MiB carry together)")
    a = ap.parse_args(argv)

    src = a.src.resolve()
    if not (src / "setup.py").is_file() or not (src / "csrc" / "flash_attn").is_dir():
        ap.error(f"--src {src} is not a flash-attention-turing checkout (no setup.py / "
                 f"csrc/flash_attn)")
    if not (src / "csrc" / "cutlass" / "include" / "cute").is_dir():
        ap.error(f"{src}/csrc/cutlass has no include/cute: check out the submodule at the commit "
                 f"the peer pins")
    commit = a.commit or git_commit(src)
    if commit is None:
        ap.error("--src is not a git work tree: pass its commit with --commit")
    import torch

    env = dict(os.environ, TORCH_CUDA_ARCH_LIST="7.5+PTX", MAX_JOBS=str(a.jobs))
    for var, path in (("CC", "/usr/bin/gcc"), ("CXX", "/usr/bin/g++")):
        if var not in env and Path(path).exists():
            env[var] = path
    out = a.out.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        # Objects in the peer's own build/ (a rebuild is incremental); the module lands in tmp.
        cmd = [sys.executable, "setup.py", "build_ext", "--build-lib", tmp]
        print("+", " ".join(cmd), f"(in {src})", flush=True)
        subprocess.run(cmd, cwd=src, env=env, check=True)
        built = sorted(Path(tmp).glob("flash_attn_turing*.so"))
        if not built:
            print("build_peer: no flash_attn_turing*.so produced", file=sys.stderr)
            return 1
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("flash_attn_turing*.so"):
            old.unlink()
        shutil.copy2(built[0], out / built[0].name)
        if not a.no_strip and shutil.which("strip"):
            subprocess.run(["strip", "--strip-unneeded", str(out / built[0].name)], check=True)
    info = {
        "repo": "https://github.com/ssiu/flash-attention-turing",
        "commit": commit,
        "cutlass_commit": a.cutlass_commit or git_commit(src / "csrc" / "cutlass"),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "arch_list": env["TORCH_CUDA_ARCH_LIST"],
        "module": built[0].name,
    }
    (out / _peer.INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    print(f"build_peer: {out / built[0].name} ({(out / built[0].name).stat().st_size / 2**20:.1f}"
          f" MiB), {out / _peer.INFO_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
