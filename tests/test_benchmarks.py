"""The benchmark scripts run end to end on CPU (their --dry-run paths, tiny shapes), and the T4
model reads the committed H200 results: so that they do not rot between GPU sessions. Without
CUDA the sweep benchmarks refuse to run unless --dry-run or --device cpu is given."""
import importlib.util
import json
import re
import subprocess

import pytest
import torch

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


@pytest.mark.parametrize("extra", [True, False], ids=["head_dim_runs", "no_extra"])
def test_t4_model_covers_every_measured_case(extra):
    r = run("benchmarks/t4_model.py", *([] if extra else ["--no-extra"]))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("MODEL, not a measurement")
    rows = [line for line in r.stdout.splitlines() if line.startswith(("| forward", "| backward"))]
    rows = [line for line in rows if len(line.split("|")) == 14]  # the per-case table
    fwd = json.loads((ROOT / "benchmarks/results/h200_forward.json").read_text())["cases"]
    bwd = json.loads((ROOT / "benchmarks/results/h200_backward.json").read_text())["cases"]
    expected = len(fwd) + len(bwd)
    if extra:  # the runs of the kernels as shipped: they replace the base runs' rows of their d
        for kind, name, _, dims, _ in load_script("benchmarks/t4_model.py").EXTRA_SOURCES:
            cases = json.loads((ROOT / "benchmarks/results" / name).read_text())["cases"]
            expected += sum(c["d"] in dims for c in cases)
            expected -= sum(c["d"] in dims for c in (bwd if kind == "backward" else fwd))
    assert len(rows) == expected
    for line in rows:
        ms, tflops = (float(x) for x in line.split("|")[6:8])
        assert ms > 0 and 0 < tflops <= 65.0  # never above the T4's tensor peak
    if extra:
        assert {int(line.split("|")[2]) for line in rows} == {64, 80, 96, 128, 256}


def _cpp_int(expr):
    """An integer literal expression of the gtests (`32 * 1024 + 1`): digits, + - * only."""
    assert re.fullmatch(r"[\d\s+*-]+", expr), expr
    return eval(expr)  # noqa: S307 (checked above: an arithmetic literal)


def test_t4_model_occupancy_twin_matches_the_cpp_rules():
    # The Python ctas_per_sm must not drift from launch_plan.h's: every assertion of the
    # DeviceProfile gtest holds for the twin, and the profiles carry the same numbers.
    m = load_script("benchmarks/t4_model.py")
    gtest = (ROOT / "tests/cpp/test_launch_plan.cpp").read_text()
    cases = re.findall(r"EXPECT_EQ\(ctas_per_sm\(t4, ([^,]+), ([^,]+), ([^)]+)\), (\d+)\)", gtest)
    assert len(cases) >= 8, "the DeviceProfile gtest changed shape: update this parser"
    for threads, regs, smem, want in cases:
        got = m.ctas_per_sm(m.PROFILE_T4, _cpp_int(threads), _cpp_int(regs), _cpp_int(smem))
        assert got == int(want), (threads, regs, smem)
    header = (ROOT / "csrc/kernels/launch_plan.h").read_text()
    for prof in (m.PROFILE_T4, m.PROFILE_RTX2080TI):
        fields = re.search(r'DeviceProfile \w+\{"%s", ([^}]+)\}' % prof.name, header).group(1)
        assert [_cpp_int(f) for f in fields.split(",")] == [
            prof.num_sms, prof.smem_per_sm, prof.threads_per_sm, prof.regs_per_sm,
            prof.max_ctas_per_sm]
    # Turing's per-scheduler register rule (4 x 16K) gives the same counts for 4- and 8-warp CTAs
    for warps in (4, 8):
        for regs in range(16, 256):
            per_warp = (regs * 32 + 255) // 256 * 256
            assert m.ctas_per_sm(m.PROFILE_T4, 32 * warps, regs, 0) == min(
                16, 32 // warps, 4 * (16384 // per_warp) // warps)


def test_t4_model_plan_twins_match_the_cpp_gtests():
    m = load_script("benchmarks/t4_model.py")
    # values asserted in tests/cpp/test_launch_plan.cpp
    assert m.plan_decode(1, 8, 8, 1, 4096, 128, 40)["num_splits"] == 16
    assert m.plan_decode(1, 8, 8, 1, 4096, 128, 132)["num_splits"] == 32
    four = m.plan_decode(1, 32, 8, 4, 5000, 128, 40, True, 8, 32)
    assert (four["use"], four["ratio_bucket"], four["head_parts"]) == (True, 16, 1)
    assert m.plan_decode(1, 32, 8, 5, 5000, 128, 40, True, 8, 32)["head_parts"] == 2
    assert m.plan_decode(1, 8, 8, 3, 5000, 64, 40, True, 8, 32)["ratio_bucket"] == 4
    assert not m.plan_decode(1, 32, 8, 9, 5000, 128, 40, True, 8, 32)["use"]
    assert not m.plan_decode(1, 32, 8, 2, 100, 128, 40)["use"]
    assert m.plan_decode(1, 3, 1, 1, 100, 256, 40)["ratio_bucket"] == 4
    assert m.plan_decode(1, 12, 1, 1, 100, 256, 40)["head_parts"] == 2
    assert m.plan_decode(1, 32, 1, 1, 100, 128, 40)["head_parts"] == 2
    assert [m.decode_max_heads_per_cta(k) for k in (64, 128, 256)] == [16, 16, 8]
    assert [m.decode_head_dim(m.head_dim_bucket(d)) for d in (40, 64, 80, 96, 128, 200)] == [
        64, 64, 128, 128, 128, 256]
    assert m.prefer_small_grid_tile(512, 396, 512, 528)
    assert not m.prefer_small_grid_tile(529, 396, 529, 528)
    assert not m.prefer_small_grid_tile(512, 120, 512, 160)


def test_t4_model_ptxas_input_covers_every_instantiation():
    # benchmarks/results/sm75_ptxas.json (scripts/check_sm75.py --json) must be regenerated when
    # an instantiation is added or removed, and every kernel in it has its launch shape.
    data = json.loads((ROOT / "benchmarks/results/sm75_ptxas.json").read_text())
    files = {p.relative_to(ROOT).as_posix()
             for p in (ROOT / "csrc/kernels/instantiations").glob("*.cu")}
    assert set(data["compile"]) == files
    assert data["launch_shapes"]["ok"] and data["ok"]
    for k in data["kernels"]:
        if k["entry"]:
            assert k["threads"] and k["dynamic_smem"] is not None, k["name"]


def test_t4_model_occupancy_table():
    r = run("benchmarks/t4_model.py")
    assert r.returncode == 0, r.stderr
    table = [line.split("|")[1:-1] for line in r.stdout.splitlines()
             if line.startswith("| ") and len(line.split("|")) == 12]
    rows = {c[0].strip(): [x.strip() for x in c] for c in table}
    m = load_script("benchmarks/t4_model.py")
    assert set(rows) >= {label for label, _ in m.occupancy_rows()}
    # (CTAs per T4 SM, warps per SM, bound by): the design's occupancy (DESIGN.md, "Modelled T4")
    expect = {"forward d=64, 64x64": ("3", "12", "registers"),
              "forward d<=64 small grid, 64x32": ("4", "16", "registers"),
              "forward d=96, 128x64 split": ("1", "8", "registers"),
              "forward d=128, 128x64 split": ("1", "8", "registers"),
              "forward d=256 plain, 128x16": ("1", "8", "registers"),
              "forward d=136-256, 64x32 d-split": ("1", "8", "registers"),
              "dK/dV d=128": ("1", "8", "registers"),
              "dK/dV d=128, K in registers": ("2", "8", "registers"),
              "dK/dV d=64, K in registers": ("2", "8", "registers"),
              "dQ d=64": ("2", "8", "registers"),
              "dK/dV d=256": ("1", "4", "shared memory"),
              "decode d=128, kR=1": ("1", "4", "shared memory")}
    for label, (ctas, warps, bound) in expect.items():
        assert (rows[label][4], rows[label][5], rows[label][6]) == (ctas, warps, bound), label
    assert rows["forward d=64, 64x64"][7] == "2"  # extended (score mod, paged): 2 CTAs per SM
    assert rows["forward d=64, 64x64"][8] == "120 / 204"


def test_t4_model_decode_bound():
    m = load_script("benchmarks/t4_model.py")
    data = json.loads((ROOT / "benchmarks/results/h200_decode.json").read_text())["results"]
    for c in data:
        out = m.decode_model(c, None, 1.3, 320.0)
        assert 0 < out["pct_bw"] <= 100 and 0 < out["pct_bw_pessimistic"] <= out["pct_bw"]
        # g / 2 FMAs per K/V byte against 64 x 40 x 1.3e9 / 320e9 = 10.4: memory-bound up to g = 20
        assert out["bound"] == "memory" and abs(
            out["t_fma_us"] / out["t_mem_us"] - c["ratio"] / 2 / 10.4) < 1e-9
    # a group of 32 q-heads per kv head (two CTAs of kR = 16) is FMA-bound: 16 / 10.4
    big = dict(d=128, ratio=32, heads=32, heads_k=1, batch=8, cache=8192, ours_ms=1.0,
               pct_copy=50.0, kv_bytes=2 * 8 * 8192 * 1 * 128 * 2)
    out = m.decode_model(big, None, 1.3, 320.0)
    assert out["bound"] == "CUDA-core FMA" and abs(out["pct_bw"] - 100 * 10.4 / 16) < 0.1
    r = run("benchmarks/t4_model.py")
    decode_rows = [line for line in r.stdout.splitlines()
                   if line.startswith("| ") and len(line.split("|")) == 15
                   and line.split("|")[1].strip().isdigit()]
    assert len(decode_rows) == len(data)


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
    # today's generation mode stays the default: a DynamicCache, transformers' compile rule
    assert json.loads(out.read_text())["generation"] == {"cache": "dynamic", "compile": "auto"}
    assert json.loads(out.read_text())["complete"] is True  # also written, incomplete, per cell
    assert "generate: dynamic cache, compile auto" in r.stdout


@pytest.mark.skipif(not fa.EXTENSION_AVAILABLE, reason="extension not built")
@pytest.mark.parametrize("cache", ["static", "static-reused"])
def test_e2e_hf_times_generation_with_a_static_cache(tmp_path, cache):
    # --cache static / static-reused (issue 23): both implementations generate with transformers'
    # StaticCache, a new one per generate or one kept per implementation and reset in place
    # (left-padded rows: the decode masks cover unfilled slots and padding); ours serves every
    # attention call of the warm-up generate, and the mode is recorded. No compile on CPU here
    # (--compile off; compiling would take tens of seconds), so no graph is compiled.
    out = tmp_path / "e2e.json"
    r = run("benchmarks/bench_e2e_hf.py", "--device", "cpu", "--config", "qwen2", "--lengths",
            "16", "--batches", "2", "--left-pad", "--new-tokens", "3", "--repeats", "1",
            "--gen-repeats", "2", "--cache", cache, "--compile", "off", "--out", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["generation"] == {"cache": cache, "compile": "off"}
    assert f"generate: {cache} cache, compile off" in r.stdout
    ours, stock = report["results"]
    for res in (ours, stock):
        assert "error" not in res, res
        assert res["new_tokens"] == 3 and len(res["gen_times_s"]) == 2
        assert res["gen_graphs_compiled"] == 0 and res["graphs_compiled_timed"] == 0
    layers = report["model"]["layers"]
    assert ours["generate_attention"] == {"kernel_prefill": layers, "kernel_decode": 2 * layers,
                                          "fallback": 0, "reasons": {}}


def test_e2e_hf_generation_modes_map_to_transformers_arguments():
    # --cache / --compile become generate()'s own arguments; all-devices needs a static cache.
    bench = load_script("benchmarks/bench_e2e_hf.py")
    args = bench.parse_args([])
    assert (args.cache, args.compile) == ("dynamic", "auto")
    assert bench.generate_kwargs(args) == {}
    assert bench.generate_kwargs(bench.parse_args(["--cache", "static"])) == {
        "cache_implementation": "static"}
    assert bench.generate_kwargs(bench.parse_args(["--cache", "static", "--compile", "off"])) == {
        "cache_implementation": "static", "disable_compile": True}
    kwargs = bench.generate_kwargs(bench.parse_args(["--cache", "static", "--compile",
                                                     "all-devices"]))
    assert kwargs["compile_config"]._compile_all_devices is True
    with pytest.raises(SystemExit):
        bench.parse_args(["--compile", "all-devices"])


@pytest.mark.parametrize("total,lo,hi,seed", [(16384, 128, 4096, 0), (16384, 128, 4096, 1),
                                              (1000, 128, 4096, 2), (300, 128, 256, 3)])
def test_varlen_documents_total_the_tokens_within_the_length_bounds(total, lo, hi, seed):
    lens = load_script("benchmarks/bench_varlen.py").doc_lengths(total, lo, hi, seed)
    assert sum(lens) == total
    assert all(x <= hi + lo for x in lens)  # a folded remainder adds < lo to one document
    assert all(x >= lo for x in lens) or len(lens) == 1
    assert lens == load_script("benchmarks/bench_varlen.py").doc_lengths(total, lo, hi, seed)


def test_peer_backend_is_optional_and_records_its_build(tmp_path, monkeypatch):
    """The SM75 peer (benchmarks/_peer.py): without a build the sweeps list it as unavailable,
    saying how to build one; with a build its PEER_INFO.json is what the report records; its
    adapter copies BHSD inputs to BSHD once per input (outside the timed calls) and passes BSHD
    views through."""
    import sys

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _peer

    monkeypatch.setenv(_peer.ENV_DIR, str(tmp_path / "none"))
    monkeypatch.setattr(_peer, "_LOADED", None)
    assert not _peer.build_found()
    assert "scripts/build_peer.py" in _peer.load().error
    r = run("benchmarks/bench_forward.py", "--dry-run", "--no-mma-peak", "--backends",
            "ours,ssiu", "--out-dir", str(tmp_path / "out"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "out" / "bench_forward.json").read_text())
    assert res["cases"][0]["backends"]["ssiu"]["status"].startswith("unavailable: no build")
    assert "ours/ssiu" in (tmp_path / "out" / "bench_forward.txt").read_text()

    build = tmp_path / "build"
    build.mkdir()
    info = {"repo": "https://github.com/ssiu/flash-attention-turing", "commit": "c" * 40}
    (build / _peer.INFO_FILE).write_text(json.dumps(info))
    monkeypatch.setenv(_peer.ENV_DIR, str(build))
    monkeypatch.setattr(_peer, "_LOADED", None)
    assert _peer.build_found()
    peer = _peer.load()
    assert peer.info["commit"] == "c" * 40 and not peer.available  # no module in it
    assert "import flash_attn_turing" in peer.error

    cache = _peer._BshdCache()
    q = torch.randn(1, 2, 5, 8)  # BHSD, contiguous: copied once
    (a,) = cache.get(q)
    assert a.is_contiguous() and torch.equal(a, q.transpose(1, 2))
    assert cache.get(q)[0] is a
    q.add_(1)  # in place: a new copy
    assert cache.get(q)[0] is not a
    s = torch.randn(1, 5, 2, 8)  # BSHD storage seen as BHSD: passed through
    assert cache.get(s.transpose(1, 2))[0].data_ptr() == s.data_ptr()


def test_build_peer_checks_its_source_tree(tmp_path):
    r = run("scripts/build_peer.py", "--src", str(tmp_path))
    assert r.returncode == 2 and "not a flash-attention-turing checkout" in r.stderr
    (tmp_path / "setup.py").write_text("")
    (tmp_path / "csrc" / "flash_attn").mkdir(parents=True)
    r = run("scripts/build_peer.py", "--src", str(tmp_path))
    assert r.returncode == 2 and "csrc/cutlass has no include/cute" in r.stderr


def test_host_ms_per_call_times_each_call_without_the_rest():
    # bench_backward's "host ms" columns: the mean host time of back-to-back calls (median of
    # the trials), each call timed on its own; one warm-up call first.
    import time

    common = load_script("benchmarks/_common.py")
    calls = []

    def fn():
        calls.append(None)
        time.sleep(0.002)

    ms = common.host_ms_per_call(fn, "cpu", calls=4, trials=3)
    assert len(calls) == 1 + 4 * 3
    assert 2.0 <= ms < 50.0


def test_e2e_hf_attention_kernels_are_told_apart_by_name():
    # --attention-share sums the prefill's attention kernels by name (ours and torch's
    # memory-efficient fmha), not its GEMMs, norms or elementwise kernels.
    m = load_script("benchmarks/bench_e2e_hf.py")
    attention = ["void flash_sm75::flash_fwd_kernel<flash_sm75::Flash_fwd_kernel_traits<"
                 "flash_sm75::FwdTileD64>, true, false, 0>(flash_sm75::Flash_fwd_params)",
                 "fmha_cutlassF_f16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel"
                 "<cutlass::half_t, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)"]
    other = ["ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_tn",
             "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl<>>",
             "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>"]
    assert all(m.ATTENTION_KERNELS.search(name) for name in attention)
    assert not any(m.ATTENTION_KERNELS.search(name) for name in other)


def test_host_overhead_cuda_step_refuses_without_a_gpu():
    # hide_cuda: the CPU path on any machine; the mode measures real kernels only.
    r = run("benchmarks/host_overhead.py", "--cuda-step", hide_cuda=True)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "--cuda-step needs a CUDA device" in r.stderr
    assert "| case |" not in r.stdout


@pytest.mark.skipif(not (fa.EXTENSION_AVAILABLE and torch.cuda.is_available()),
                    reason="needs the extension and a CUDA device")
@pytest.mark.parametrize("causal", [False, True])
def test_host_overhead_cuda_step_table(causal):
    # One run of 5 steps per case: a step's host time is part of its wall time, so host <= wall.
    args = ["--cuda-step", "--n", "5", "--repeats", "1", "--cuda-shape", "1", "2", "130", "64"]
    r = run("benchmarks/host_overhead.py", *args, *(["--causal"] if causal else []))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = {}
    for line in r.stdout.splitlines():
        m = re.match(r"\| (.+?) \| ([0-9.]+) \| ([0-9.]+) \|$", line)
        if m:
            rows[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    assert set(rows) == {"flash_attn_func", "flash_attention_forward", "sdpa wrapper",
                         "torch mem-efficient"}, r.stdout
    for name, (wall, host) in rows.items():
        assert 0 < host <= wall, (name, wall, host)
    prof = run("benchmarks/host_overhead.py", "--cuda-step", "--profile", "flash_attn_func",
               "--cuda-shape", "1", "2", "130", "64")
    assert prof.returncode == 0, prof.stderr[-2000:]
    assert "Self CPU" in prof.stdout
