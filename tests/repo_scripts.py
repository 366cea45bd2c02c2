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
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def load_script(relpath):
    """Import the script at relpath (relative to the repository root) as a fresh module."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(f"_test_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
