"""The mem_eff_sm75 baseline (benchmarks/_memeff_sm75.py, scripts/build_memeff_sm75.py,
benchmarks/baselines/memeff_sm75.cu): torch's mem-efficient kernels as a T4 runs them.

CPU tests of the host logic: without a build the sweeps list the backend as unavailable (saying
how to build it) and run without it; a build's BASELINE_INFO.json is what the report records;
the --backends wiring; the check against SDPA that drops a baseline that disagrees or raises.
When a build is present (.peer/memeff_sm75), its library is loaded on the CPU (a subprocess) for
its plan and its argument errors. The GPU test compares it with SDPA (skipped without a GPU or a
build)."""
import json
import subprocess
import sys
import types

import pytest
import torch

from repo_scripts import ROOT, load_script, run_script

sys.path.insert(0, str(ROOT / "benchmarks"))
import _memeff_sm75 as base  # noqa: E402

SWEEPS = ["bench_forward", "bench_backward"]
BUILD = ROOT / ".peer" / "memeff_sm75"
HAS_BUILD = (BUILD / base.INFO_FILE).is_file() and (BUILD / base.LIBRARY).is_file()


@pytest.fixture
def fresh(monkeypatch):
    """The loader as a new process sees it (the library itself is never loaded in-process)."""
    monkeypatch.setattr(base, "_LOADED", None)
    monkeypatch.setattr(base, "_LOADED_FROM", None)
    return monkeypatch


def test_without_a_build_the_backend_is_unavailable_and_the_sweep_runs(tmp_path, fresh):
    fresh.setenv(base.ENV_DIR, str(tmp_path / "none"))
    assert not base.build_found()
    b = base.load()
    assert not b.available and "scripts/build_memeff_sm75.py" in b.error
    assert b.describe().startswith("UNAVAILABLE: no build in")

    for script in SWEEPS:
        out = tmp_path / script
        extra = ["--no-mma-peak"] if script == "bench_forward" else []
        r = run_script(f"benchmarks/{script}.py", "--dry-run", *extra, "--d", "64", "--n", "64",
                       "--backends", "ours,mem_eff_sm75", "--out-dir", str(out), "--no-plot",
                       hide_cuda=True)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        res = json.loads((out / f"{script}.json").read_text())
        for c in res["cases"]:
            assert c["backends"]["mem_eff_sm75"]["status"].startswith("unavailable: no build")
            assert c["backends"]["ours"]["status"] == "ok"
        assert "scripts/build_memeff_sm75.py" in res["mem_eff_sm75"]["error"]
        assert res["mem_eff_sm75"]["dropped"] is None
        text = (out / f"{script}.txt").read_text()
        assert "baseline mem_eff_sm75: UNAVAILABLE" in text
        ratio = "ours/mem_eff_sm75" if script == "bench_forward" else "mem_eff_sm75/ours"
        assert ratio in text


def test_a_build_records_its_info_and_says_why_it_does_not_load(tmp_path, fresh):
    build = tmp_path / "build"
    build.mkdir()
    info = {"torch": "2.11.0+cu130", "cutlass_commit": "c" * 40, "cutlass_version": "4.3.2",
            "arch_list": "compute_75 PTX + sm_75 SASS", "library": base.LIBRARY,
            "kernels_per_head_dim": {"64": {"forward": "F", "backward": "B"}}}
    (build / base.INFO_FILE).write_text(json.dumps(info))
    fresh.setenv(base.ENV_DIR, str(build))
    assert base.build_found()
    b = base.load()
    assert b.info["cutlass_commit"] == "c" * 40 and not b.available  # no library in it
    assert "loading" in b.error and base.LIBRARY in b.error
    assert base.load() is b  # once per process

    # the report's JSON field: the info, the error, the drop
    common = load_script("benchmarks/_common.py")
    args = types.SimpleNamespace(backend_list=["ours", "mem_eff_sm75"])
    runner = types.SimpleNamespace(dropped={"mem_eff_sm75": "why"})
    rec = common.baseline_info(args, runner)
    assert rec["cutlass_commit"] == "c" * 40 and rec["error"] == b.error
    assert rec["dropped"] == "why"
    assert common.baseline_info(types.SimpleNamespace(backend_list=["ours"])) is None

    (build / base.INFO_FILE).write_text("{not json")
    fresh.setattr(base, "_LOADED", None)
    assert "not valid JSON" in base.load().error


def test_a_second_build_in_one_process_is_refused(tmp_path, fresh):
    build = tmp_path / "b"
    build.mkdir()
    (build / base.INFO_FILE).write_text(json.dumps({"library": base.LIBRARY}))
    fresh.setenv(base.ENV_DIR, str(build))
    fresh.setattr(base, "_LOADED_FROM", tmp_path / "other" / base.LIBRARY)
    b = base.MemEffSm75()
    assert not b.available and "is loaded in this process already" in b.error


@pytest.mark.parametrize("script", SWEEPS)
def test_backends_option_takes_the_baseline(script, tmp_path):
    module = load_script(f"benchmarks/{script}.py")
    a = module.parse_args(["--dry-run", "--backends", "ours,efficient,mem_eff_sm75,ssiu",
                           "--out-dir", str(tmp_path)])
    assert a.backend_list == ["ours", "efficient", "mem_eff_sm75", "ssiu"]
    if script == "bench_backward":
        assert "mem_eff_sm75" in a.series
    with pytest.raises(SystemExit):
        module.parse_args(["--dry-run", "--backends", "ours,mem_eff", "--out-dir",
                           str(tmp_path)])


def test_backends_help_and_error_name_the_baseline(tmp_path):
    r = run_script("benchmarks/bench_forward.py", "--dry-run", "--backends", "ours,nope",
                   "--out-dir", str(tmp_path / "o"), hide_cuda=True, timeout=120)
    assert r.returncode == 2 and "mem_eff_sm75" in r.stderr, r.stderr[-1000:]
    r = run_script("benchmarks/bench_backward.py", "--help", hide_cuda=True, timeout=120)
    assert "mem_eff_sm75" in r.stdout and "build_memeff_sm75.py" in r.stdout


def _qkv(grad=False, n=24, d=16):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 3, n, d, generator=g).requires_grad_(grad) for _ in range(3)]


def _sdpa(q, k, v, causal):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


class _HalfGradQ(torch.autograd.Function):
    """SDPA whose dq comes back halved: a backward that disagrees."""

    @staticmethod
    def forward(ctx, q, k, v, causal):
        with torch.enable_grad():
            qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
            out = _sdpa(qd, kd, vd, causal)
        ctx.save_for_backward(qd, kd, vd, out)
        return out.detach()

    @staticmethod
    def backward(ctx, dout):
        qd, kd, vd, out = ctx.saved_tensors
        dq, dk, dv = torch.autograd.grad(out, (qd, kd, vd), dout)
        return dq / 2, dk, dv, None


@pytest.mark.parametrize("causal", [False, True])
def test_check_against_sdpa_passes_a_match_and_names_a_mismatch(causal):
    q, k, v = _qkv()
    assert base.check_against_sdpa(_sdpa, q, k, v, causal) is None
    wrong = base.check_against_sdpa(lambda *a: torch.zeros_like(a[0]), q, k, v, causal)
    assert wrong.startswith("output: max |diff|")
    other_mask = base.check_against_sdpa(lambda q, k, v, c: _sdpa(q, k, v, not c), q, k, v, causal)
    assert other_mask.startswith("output: max |diff|")
    nan = base.check_against_sdpa(lambda *a: _sdpa(*a) * float("nan"), q, k, v, causal)
    assert nan == "output: non-finite values"

    def boom(*a):
        raise RuntimeError("memeff_sm75: q must be a CUDA tensor\nmore")
    assert base.check_against_sdpa(boom, q, k, v, causal) == \
        "raised RuntimeError: memeff_sm75: q must be a CUDA tensor"

    qg, kg, vg = _qkv(grad=True)
    do = torch.randn_like(qg)
    assert base.check_against_sdpa(_sdpa, qg, kg, vg, causal, do) is None
    bad = base.check_against_sdpa(_HalfGradQ.apply, qg, kg, vg, causal, do)
    assert bad.startswith("dq: max |diff|"), bad
    assert qg.grad is None  # autograd.grad: nothing accumulated in the benchmark's inputs


class _StubRunner:
    """A SweepRunner whose mem_eff_sm75 impl is `fn` (the gate's host logic on the CPU)."""

    def __new__(cls, fn, log):
        common = load_script("benchmarks/_common.py")

        class Runner(common.SweepRunner):
            calls = 0

            def impl(self, name):
                Runner.calls += 1
                if fn is None:
                    return None, None, "no build"
                return fn, __import__("contextlib").nullcontext, None

        args = types.SimpleNamespace(device="cpu", no_triton=True,
                                     backend_list=["ours", "mem_eff_sm75"])
        return Runner(args, log)


def test_gate_drops_a_disagreeing_baseline_for_the_rest_of_the_run():
    lines = []
    q, k, v = _qkv()
    runner = _StubRunner(lambda *a: torch.zeros_like(a[0]), lines.append)
    first = runner.gate("mem_eff_sm75", ("mem_eff_sm75",), q, k, v, False)
    assert first.startswith("dropped: disagrees with torch SDPA on the first check (output:")
    assert runner.dropped["mem_eff_sm75"] in first
    assert any("mem_eff_sm75 dropped from the run" in line for line in lines)
    calls = type(runner).calls
    again = runner.gate("mem_eff_sm75", ("mem_eff_sm75",), q, k, v, True)
    assert again == first and type(runner).calls == calls  # not run again
    assert runner.gate("efficient", ("efficient",), q, k, v, False) is None  # not gated

    ok = _StubRunner(_sdpa, lines.append)
    assert ok.gate("mem_eff_sm75", ("mem_eff_sm75",), q, k, v, False) is None
    assert ok.dropped == {}
    absent = _StubRunner(None, lines.append)  # unavailable: prepare() records why
    assert absent.gate("mem_eff_sm75", ("mem_eff_sm75",), q, k, v, False) is None


def test_build_script_checks_its_cutlass_tree(tmp_path):
    r = run_script("scripts/build_memeff_sm75.py", "--cutlass-dir", str(tmp_path), "--out",
                   str(tmp_path / "out"), timeout=120)
    assert r.returncode == 2 and "has no include/cutlass/version.h" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


_PROBE = """
import json, sys, torch
torch.ops.load_library(sys.argv[1])
m = torch.ops.memeff_sm75
res = {"plan": {d: m.plan(d) for d in (64, 96, 128, 256)}, "kernels": m.kernels(), "errors": {}}
q = torch.randn(1, 8, 2, 64, dtype=torch.float16)
cases = {"cpu": (q, q, q), "float32": (q.float(),) * 3, "d32": (q[..., :32],) * 3,
         "d36": (torch.randn(1, 8, 2, 36, dtype=torch.float16),) * 3,
         "3d": (q[0],) * 3}
for name, args in cases.items():
    try:
        m.fwd(*args, False)
        res["errors"][name] = None
    except RuntimeError as e:
        res["errors"][name] = str(e).splitlines()[0]
try:
    m.bwd(q, q, q, q, q, torch.zeros(1, 2, 32), False)
except RuntimeError as e:
    res["errors"]["bwd_cpu"] = str(e).splitlines()[0]
print(json.dumps(res))
"""


@pytest.mark.skipif(not HAS_BUILD, reason="no build in .peer/memeff_sm75 "
                                           "(scripts/build_memeff_sm75.py)")
def test_built_library_loads_on_the_cpu_with_its_plan_and_argument_errors():
    info = json.loads((BUILD / base.INFO_FILE).read_text())
    r = subprocess.run([sys.executable, "-c", _PROBE, str(BUILD / base.LIBRARY)],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0 and "libcudart" in r.stderr:
        pytest.skip("this torch cannot load a CUDA library here")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    # torch's sm75 fp16 dispatch on a 64 KiB SM
    assert res["plan"]["64"] == ["F_f16_aligned_64x64_rf_sm75", "B_f16_aligned_64x64_k64_sm75"]
    assert res["plan"]["96"] == res["plan"]["128"] == [
        "F_f16_aligned_32x128_rf_sm75", "B_f16_aligned_128x64_k128_sm75"]
    assert res["plan"]["256"] == ["F_f16_aligned_32x128_gmem_sm75",
                                  "B_f16_aligned_128x64_k65536_sm75"]
    for d, p in info["kernels_per_head_dim"].items():
        if d in res["plan"]:
            assert [p["forward"], p["backward"]] == res["plan"][d]
    built = {row.split()[0] for row in res["kernels"] if row.split()[2] == "built"}
    assert built == {name for d in res["plan"].values() for name in d}
    for row in res["kernels"]:
        assert int(row.split()[3]) <= 64 * 1024 or row.split()[2] == "not-built"
    err = res["errors"]
    assert err["cpu"] == "memeff_sm75: q must be a CUDA tensor, got cpu"
    assert err["float32"].startswith("memeff_sm75: q must be float16")
    assert err["d32"].startswith("memeff_sm75: head_dim 32 not supported")
    assert err["d36"].startswith("memeff_sm75: head_dim 36 not supported")
    assert err["3d"].startswith("memeff_sm75: q must be 4-D BSHD")
    assert err["bwd_cpu"] == "memeff_sm75: q must be a CUDA tensor, got cpu"
    assert info["cutlass_commit"] and info["torch"] and "compute_75" in info["arch_list"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_BUILD, reason="no build in .peer/memeff_sm75")
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gpu_baseline_matches_sdpa(d, causal, layout):
    b = base.load()  # the build in $FLASH_SM75_MEMEFF_SM75_DIR or .peer/memeff_sm75
    assert b.available, b.error
    g = torch.Generator(device="cuda").manual_seed(d)
    shape = (2, 300, 4, d) if layout == "bshd" else (2, 4, 300, d)

    def mk(grad):
        t = torch.randn(shape, generator=g, device="cuda", dtype=torch.float16)
        t = t.transpose(1, 2) if layout == "bshd" else t
        return t.requires_grad_(grad)
    q, k, v = mk(False), mk(False), mk(False)
    assert base.check_against_sdpa(b.bhsd, q, k, v, causal) is None
    q, k, v, do = mk(True), mk(True), mk(True), mk(False)
    assert base.check_against_sdpa(b.autograd_bhsd(), q, k, v, causal, do) is None
    out, lse = b.ops.fwd(q.detach().transpose(1, 2), k.detach().transpose(1, 2),
                         v.detach().transpose(1, 2), causal, None, True)
    assert lse.shape == (2, 4, 320)  # padded to 32 as torch's kernel writes it
