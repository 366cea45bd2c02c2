"""The benchmark scripts run end to end on CPU (their --dry-run paths, tiny shapes), and the T4
model reads the committed H200 results: so that they do not rot between GPU sessions. Without
CUDA the sweep benchmarks refuse to run unless --dry-run or --device cpu is given."""
import importlib.util
import json
import subprocess

import pytest

import flash_attention_sm75 as fa
from repo_scripts import ROOT, load_script, run_script

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


run = run_script


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


SWEEPS = ["bench_forward", "bench_backward"]


def _load(script):
    return load_script(f"benchmarks/{script}.py")


@pytest.fixture
def no_cuda(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("script", SWEEPS)
@pytest.mark.parametrize("extra", [[], ["--quick"], ["--n", "1024"]], ids=["default", "quick", "n"])
def test_sweep_without_cuda_refuses_instead_of_running_on_the_cpu(script, extra, no_cuda, capsys,
                                                                  tmp_path):
    # It used to pick the CPU silently and run the full-size sweep there (OOM-killed).
    with pytest.raises(SystemExit) as info:
        _load(script).parse_args(["--out-dir", str(tmp_path / "out"), *extra])
    assert info.value.code == 2  # argparse's parser.error
    err = capsys.readouterr().err
    assert "CUDA is not available" in err and "--dry-run" in err and "--device cpu" in err, err


@pytest.mark.parametrize("script", SWEEPS)
def test_sweep_on_cpu_only_when_asked_and_with_the_dry_run_sizes(script, no_cuda, tmp_path):
    module = _load(script)
    dry = module.parse_args(["--dry-run", "--out-dir", str(tmp_path)])
    cpu = module.parse_args(["--device", "cpu", "--out-dir", str(tmp_path)])
    for a in (dry, cpu):
        assert a.device == "cpu"
    for name in ("d", "n", "batch", "heads"):
        assert getattr(cpu, name) == getattr(dry, name), name
    # explicit sizes still win on the CPU
    n = [2 * max(dry.n)]
    assert module.parse_args(["--device", "cpu", "--n", *map(str, n),
                              "--out-dir", str(tmp_path)]).n == n


@pytest.mark.parametrize("script", SWEEPS)
def test_sweep_command_line_without_cuda_exits_with_the_message(script, tmp_path):
    out = tmp_path / "out"
    try:
        r = run_script(f"benchmarks/{script}.py", "--out-dir", str(out), timeout=120,
                       hide_cuda=True)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{script} started a sweep without CUDA instead of refusing")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "CUDA is not available" in r.stderr
    assert not out.exists()  # nothing ran


@pytest.mark.parametrize("script", ["bench_forward", "bench_backward"])
@pytest.mark.parametrize("args", [["--batch", "0"], ["--n", "128", "0"], ["--heads", "-2"]])
def test_sweep_rejects_sizes_below_one_with_a_usage_error(script, args, tmp_path):
    # --batch 0 used to become 1 silently and --n 0 gave an empty table, then "no timing".
    r = run_script(f"benchmarks/{script}.py", "--dry-run", "--out-dir", str(tmp_path / "o"),
                   *args, timeout=120, hide_cuda=True)
    assert r.returncode == 2, r.stdout[-1000:] + r.stderr[-1000:]
    assert f"argument {args[0]}: must be an integer >= 1" in r.stderr, r.stderr[-1000:]
    assert not (tmp_path / "o").exists()



@pytest.mark.skipif(not fa.EXTENSION_AVAILABLE, reason="extension not built")
def test_e2e_hf_interleaves_the_implementations_and_reports_the_spread(tmp_path):
    # bench_e2e_hf's timing (issue 23): each implementation warmed up, then its timed
    # repetitions alternate with the other's; every raw time and the spread are kept.
    out = tmp_path / "e2e.json"
    r = run("benchmarks/bench_e2e_hf.py", "--device", "cpu", "--config", "qwen2", "--lengths",
            "16", "--batches", "1", "--new-tokens", "2", "--repeats", "3", "--gen-repeats", "2",
            "--out", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert [res["impl"] for res in results] == ["ours", "stock"]
    for res in results:
        assert "error" not in res, res
        assert len(res["prefill_times_s"]) == 3 and len(res["gen_times_s"]) == 2
        assert res["gen_spread_pct"] >= 0 and res["prefill_spread_pct"] >= 0
        assert res["new_tokens"] == 2 and res["gen_tok_s"] > 0
    assert results[0]["prefill_attention"]["kernel"] > 0  # ours ran the kernel path
    assert "gen spread % ours" in r.stdout


@pytest.mark.parametrize("total,lo,hi,seed", [(16384, 128, 4096, 0), (16384, 128, 4096, 1),
                                              (1000, 128, 4096, 2), (300, 128, 256, 3)])
def test_varlen_documents_total_the_tokens_within_the_length_bounds(total, lo, hi, seed):
    lens = load_script("benchmarks/bench_varlen.py").doc_lengths(total, lo, hi, seed)
    assert sum(lens) == total
    assert all(x <= hi + lo for x in lens)  # a folded remainder adds < lo to one document
    assert all(x >= lo for x in lens) or len(lens) == 1
    assert lens == load_script("benchmarks/bench_varlen.py").doc_lengths(total, lo, hi, seed)
