"""The benchmark scripts run end to end on CPU (their --dry-run paths, tiny shapes), and the T4
model reads the committed H200 results: so that they do not rot between GPU sessions."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

import flash_attention_sm75 as fa

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def run(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.skipif(not fa.EXTENSION_AVAILABLE, reason="extension not built")
@pytest.mark.parametrize("script", ["bench_forward", "bench_backward"])
def test_benchmark_dry_run_writes_its_outputs(script, tmp_path):
    r = run(f"benchmarks/{script}.py", "--dry-run", "--out-dir", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for ext in ("json", "txt") + (("png",) if HAS_MATPLOTLIB else ()):  # plot: extra "bench"
        assert (tmp_path / f"{script}.{ext}").stat().st_size > 0
    cases = json.loads((tmp_path / f"{script}.json").read_text())["cases"]
    assert cases and all("ours" in c["backends"] for c in cases)


def test_t4_model_covers_every_measured_case():
    r = run("benchmarks/t4_model.py")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("MODEL, not a measurement")
    rows = [line for line in r.stdout.splitlines() if line.startswith(("| forward", "| backward"))]
    fwd = json.loads((ROOT / "benchmarks/results/h200_forward.json").read_text())["cases"]
    bwd = json.loads((ROOT / "benchmarks/results/h200_backward.json").read_text())["cases"]
    assert len(rows) == len(fwd) + len(bwd)
    for line in rows:
        ms, tflops = (float(x) for x in line.split("|")[6:8])
        assert ms > 0 and 0 < tflops <= 65.0  # never above the T4's tensor peak
