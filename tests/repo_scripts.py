"""Helpers for tests that exercise the repository's scripts (benchmarks/, examples/): run one in
a subprocess with the checkout on PYTHONPATH, or import it as a module."""
import importlib.util
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_script(*args, timeout=300, hide_cuda=False):
    """`python *args` from the repository root (args[0]: a path relative to it); stdout and
    stderr captured as text. hide_cuda: CUDA_VISIBLE_DEVICES="" (the CPU paths on any machine)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if hide_cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    # Under pytest-xdist, each worker's script would start as many CPU threads as the machine
    # has cores: with 15 workers on 16 cores, bench_forward --dry-run ran past its 300 s on the GPU
    # machine (and passed there with 4 workers). A share of the cores each, unless the caller chose.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if workers > 1:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def load_script(relpath):
    """Import the script at relpath (relative to the repository root) as a fresh module."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(f"_test_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
