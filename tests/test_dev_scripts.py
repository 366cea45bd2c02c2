"""CPU tests of the development scripts in scripts/ that need no GPU for part of their work:
the ncu stall-sample summary (and its hot-loop and wavefront views), tune_fwd.py's and tune_bwd.py's source generation and spec checks,
the backward problem they share (benchmarks/_common.py), and gpu_suite.sh's test groups."""
import csv
import os
import shutil
import subprocess

import pytest

from repo_scripts import ROOT, load_script, run_script


def _write_csv(path, rows):
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_barrier",
              "stall_long_sb", "stall_long_sb (Not Issued)"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["some ncu preamble line"])
        w.writerow(header)
        w.writerows(rows)


def test_ncu_source_stalls_sums_samples_per_opcode_and_reason(tmp_path):
    mod = load_script("scripts/ncu_source_stalls.py")
    path = tmp_path / "src.csv"
    _write_csv(path, [["0x10", "@!P2  BRA 0x7f00", "900", "880", "0", "0"],
                      ["0x20", "FSETP.NEU.FTZ.AND P2, PT, R9, -INF , PT", "300", "0", "290", "280"],
                      ["0x30", "LDG.E.128 R4, desc[UR6][R2.64]", "1,100", "0", "1,000", "900"],
                      ["0x40", "LDG.E.128 R8, desc[UR6][R6.64]", "100", "0", "0", "0"]])
    header, rows = mod.read(str(path))
    out = (tmp_path / "out.txt").open("w")
    s = mod.summarise(header, rows, top=2, out=out)
    out.close()
    assert s["total"] == 2400
    assert s["per_opcode"] == {"BRA": 900, "FSETP": 300, "LDG": 1200}
    # "(Not Issued)" columns are a subset of the same samples, not another reason.
    assert s["per_reason"] == {"stall_barrier": 880, "stall_long_sb": 1290}
    text = (tmp_path / "out.txt").read_text()
    top = text.split("top 2 instructions")[1].splitlines()[1:]
    assert "LDG.E.128 R4" in top[0] and "stall_long_sb=1,000" in top[0]
    assert "BRA" in top[1] and "stall_barrier=880" in top[1]


def test_ncu_source_stalls_rejects_a_csv_without_the_sass_columns(tmp_path):
    path = tmp_path / "details.csv"
    path.write_text('"ID","Kernel Name","Metric Name","Metric Value"\n"0","k","a","1"\n')
    r = run_script("scripts/ncu_source_stalls.py", str(path))
    assert r.returncode == 2
    assert "--page source --csv --print-source sass" in r.stderr


def _write_source_csv(path, rows):
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_short_sb",
              "Instructions Executed", "L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def _ncu_view(tmp_path, rows, view: str, *args):
    """scripts/ncu_source_stalls.py's `view` (hot_loop, wavefronts) on a source CSV of `rows`:
    (its return value, what it printed)."""
    mod = load_script("scripts/ncu_source_stalls.py")
    path = tmp_path / "src.csv"
    _write_source_csv(path, rows)
    header, rows = mod.read(str(path))
    with (tmp_path / "out.txt").open("w") as out:
        result = getattr(mod, view)(header, rows, *args, out=out)
    return result, (tmp_path / "out.txt").read_text()


def test_ncu_source_stalls_hot_loop_lists_the_loop_body_in_program_order(tmp_path):
    # A prologue run once per thread block, a loop body run 4,096 times (its back branch and
    # exit test once more), an epilogue; the body's LDSM is consumed two instructions later.
    listed, text = _ncu_view(tmp_path, [
        ["0x00", "S2R R0, SR_TID.X", "10", "0", "16", "0", "0"],
        ["0x10", "LDSM.16.M88.4 R8, [R2]", "5", "0", "4,096", "16,384", "16,384"],
        ["0x20", "IMAD R3, R3, 0x2, RZ", "7", "0", "4,096", "0", "0"],
        ["0x30", "HMMA.1688.F32 R12, R4, R8, R12", "900", "850", "4,096", "0", "0"],
        ["0x40", "@P0 BRA 0x10", "20", "0", "4,112", "0", "0"],
        ["0x50", "STS.128 [R5], R12", "3", "0", "16", "256", "128"]], "hot_loop", 0.9)
    assert [sass.split(" ")[0] for _, _, _, sass in listed] == ["LDSM.16.M88.4", "IMAD", "HMMA.1688.F32", "@P0"]
    assert [k for k, _, _, _ in listed] == [1, 2, 3, 4]
    assert "stall_short_sb=850" in text and "S2R" not in text and "STS" not in text


def test_ncu_source_stalls_wavefronts_reports_the_excess_over_ideal(tmp_path):
    per, _ = _ncu_view(tmp_path, [
        ["0x10", "LDSM.16.M88.4 R8, [R2]", "5", "0", "4,096", "16,384", "16,384"],
        ["0x20", "@!P1 LDSM.16.M88.4 R12, [R2+0x20]", "5", "0", "4,096", "16,384", "16,384"],
        ["0x50", "STS.128 [R5], R12", "3", "0", "16", "256", "128"],
        ["0x60", "HMMA.1688.F32 R12, R4, R8, R12", "9", "0", "4,096", "0", "0"]], "wavefronts")
    assert per == {"LDSM.16.M88.4": (32768, 32768), "STS.128": (256, 128)}


def test_ncu_source_stalls_hot_loop_names_the_missing_column(tmp_path):
    path = tmp_path / "src.csv"
    _write_csv(path, [["0x10", "@!P2  BRA 0x7f00", "900", "880", "0", "0"]])
    r = run_script("scripts/ncu_source_stalls.py", str(path), "--hot-loop")
    assert r.returncode == 2
    assert "Instructions Executed" in r.stderr and "SourceCounters" in r.stderr


def test_tune_bwd_generates_one_renamed_namespace_per_variant_directory(tmp_path):
    pytest.importorskip("torch.utils.cpp_extension")
    variant = tmp_path / "v1"
    variant.mkdir()
    (variant / "flash_bwd_kernel.h").write_text("// an edited copy\n")
    r = run_script("scripts/tune_bwd.py", "--gen-only", "--dkdv", "32,64,8",
                   f"128/{variant}:32,64,8", "64/default", "--dq", "32,8", "default",
                   hide_cuda=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = ROOT / r.stdout.strip().splitlines()[-1]
    tus = [(out / f"v{i}.cu").read_text() for i in range(5)]
    # base variants use the library's own namespace and headers ...
    assert "#define flash_sm75" not in tus[0]
    assert f'#include "{ROOT / "csrc/kernels"}/flash_bwd_kernel.h"' in tus[0]
    assert "flash_sm75::Flash_bwd_kernel_traits<128, 32, 64, 8>" in tus[0]
    assert "flash_sm75::flash_bwd_dkdv_kernel<Kr, true, false>" in tus[0]
    # ... a copied directory gets its own namespace, and its own headers.
    assert "#define flash_sm75 flash_sm75_v1" in tus[1] and "#undef flash_sm75" in tus[1]
    assert f'#include "{variant}/flash_bwd_kernel.h"' in tus[1]
    assert "flash_sm75_v1::flash_bwd_dkdv_kernel<Kr, true, false>" in tus[1]
    assert "flash_sm75::Bwd_tile_config<64>::Traits" in tus[2]
    assert "flash_bwd_dkdv_kernel<Kr, false, false>" in tus[2]
    assert "Flash_bwd_dq_kernel_traits<128, 32, 8>" in tus[3]
    # "default" is the dQ tile the library launches (d = 128's double-buffered one).
    assert "flash_sm75::Bwd_tile_config<128>::DqTraits" in tus[4]
    assert "flash_bwd_dq_kernel<Kr" in tus[4]
    bind = (out / "bind.cpp").read_text()
    assert all(f"case {i}: run_" in bind for i in range(5))


@pytest.mark.parametrize("args, message", [
    (["--dkdv", "16,4"], "Br,Bc,warps or default"),
    (["--dq", "32"], "Bc,warps"),
    (["--dkdv", "no_such_dir:16,4,0"], "holds no flash_bwd_kernel.h"),
    ([], "give at least one variant"),
])
def test_tune_bwd_rejects_bad_specs_with_a_usage_error(args, message):
    pytest.importorskip("torch.utils.cpp_extension")
    r = run_script("scripts/tune_bwd.py", "--gen-only", *args, hide_cuda=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_tune_fwd_writes_each_variant_as_a_named_tile(tmp_path):
    pytest.importorskip("torch.utils.cpp_extension")
    r = run_script("scripts/tune_fwd.py", "--gen-only", "--variants", "FwdTileD128,split=0,rescale=4",
                   "d=64,bm=64,bn=32,warps=4,q_in_smem=1,min_blocks=4", "FwdTileD64",
                   hide_cuda=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = ROOT / r.stdout.strip().splitlines()[-1]
    tus = [(out / f"v{i}.cu").read_text() for i in range(3)]
    # A shipped tile as the base, with overrides ...
    assert "struct TuneTile0 : FwdTileD128 {" in tus[0]
    assert "static constexpr bool kSplitTile = false;" in tus[0]
    assert "static constexpr int kRescaleThreshold = 4;" in tus[0]
    assert "using Kt = Flash_fwd_kernel_traits<TuneTile0>;" in tus[0]
    # ... a tile from the defaults, every field named ...
    assert "struct TuneTile1 : FwdTileDefaults {" in tus[1]
    for field in ("int kHeadDim = 64;", "int kBlockM = 64;", "int kBlockN = 32;",
                  "int kNWarps = 4;", "bool kQInSmem = true;", "int kMinBlocksPerSm = 4;"):
        assert f"static constexpr {field}" in tus[1], field
    # ... and a shipped tile as it is.
    assert "struct TuneTile2 : FwdTileD64 {\n};" in tus[2]
    bind = (out / "bind.cpp").read_text()
    assert all(f"case {i}: run_variant_{i}(p, s);" in bind for i in range(3))
    assert all(f"case {i}: return head_dim_{i}();" in bind for i in range(3))


@pytest.mark.parametrize("variant, message", [
    ("FwdTileD32", "is not one of FwdTileD64, FwdTileD64SmallGrid, FwdTileD128"),
    ("d=64,bm=64,bn=64", "a tile without a base needs warps"),
    ("FwdTileD64,pingpong=1", "is not key=integer"),
    ("FwdTileD64,bn=x", "is not key=integer"),
])
def test_tune_fwd_rejects_bad_variants_with_a_usage_error(variant, message):
    pytest.importorskip("torch.utils.cpp_extension")
    r = run_script("scripts/tune_fwd.py", "--gen-only", "--variants", variant, hide_cuda=True,
                   timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_bwd_problem_gives_the_ops_forward_and_gradients_of_its_seeded_inputs():
    torch = pytest.importorskip("torch")
    from flash_attention_sm75 import _ops
    if not _ops.EXTENSION_AVAILABLE:
        pytest.skip("extension not built")
    common = load_script("benchmarks/_common.py")
    pb = common.bwd_problem(1, 2, 33, 64, True, device="cpu")
    again = common.bwd_problem(1, 2, 33, 64, True, device="cpu")
    assert torch.equal(pb["q"], again["q"]) and torch.equal(pb["dout"], again["dout"])
    assert pb["q"].shape == (1, 33, 2, 64) and pb["q"].dtype == torch.float16
    assert pb["scale"] == 64 ** -0.5
    # ref = the gradients of out = attention(q, k, v) (bottom-right causal) against dout.
    q, k, v = (pb[x].double().requires_grad_() for x in "qkv")
    mask = torch.ones(33, 33, dtype=torch.bool).tril()
    p = ((q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)) * pb["scale"]).masked_fill(
        ~mask, float("-inf")).softmax(-1)
    out = (p @ v.transpose(1, 2)).transpose(1, 2)
    assert (out - pb["out"].double()).abs().max() < 2e-3
    grads = torch.autograd.grad(out, (q, k, v), pb["dout"].double())
    for g, r in zip(grads, pb["ref"]):
        assert r.shape == g.shape and (g - r.double()).abs().max() < 2e-2


def test_check_sm75_proxy_reports_the_jit_target_beside_sm75():
    """--proxy sm_90: the same compute_75 PTX compiled for the stand-in GPU; its registers and
    spills come as extra columns (read from ptxas), and never decide the check."""
    nvcc = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"),
            shutil.which("nvcc")]
    if not any(c and os.access(c, os.X_OK) for c in nvcc):
        pytest.skip("no nvcc (check_sm75.py needs one)")
    src = "csrc/kernels/instantiations/flash_bwd_hdim64_fp16_sm75.cu"
    r = run_script("scripts/check_sm75.py", "--skip-generate-check", "--proxy", "sm_90", src)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    header = next(line for line in r.stdout.splitlines() if line.startswith("file "))
    assert "sm_90 regs" in header and "sm_90 spill st/ld" in header
    rows = [line for line in r.stdout.splitlines() if "flash_bwd_dkdv_kernel" in line]
    assert rows
    # Each row: sm_75 regs, spills, stack, smem, then the sm_90 register count and spills.
    cells = rows[0].split()
    st, ld = cells[-2].split("/")
    assert 0 < int(cells[-3]) <= 255 and int(st) >= 0 and int(ld) >= 0
    assert "sm_90 (informational):" in r.stdout


def _newest_torch_harness(tmp_path, env_lines):
    """scripts/test.sh's step-5 function run on its own, with the script's helpers stubbed."""
    text = (ROOT / "scripts" / "test.sh").read_text()
    start = text.index("newest_torch() {")
    end = text.index("\n}\n", start) + 3
    harness = tmp_path / "harness.sh"
    harness.write_text(
        "set -euo pipefail\n"
        f"ROOT={tmp_path}; RESULTS=$ROOT/results; mkdir -p $RESULTS\n"
        # PY=false: should the guard let the step start, it fails at once creating the venv
        # instead of downloading torch.
        "PY=false; MAX_JOBS=2; SUMMARY=(); FAILED=0\n"
        'log() { echo "LOG $*"; }\n'
        'fail() { FAILED=1; SUMMARY+=("$1 FAILED"); }\n'
        + text[start:end] + "\n" + "\n".join(env_lines) + "\n"
        'printf "SUMMARY %s\\n" "${SUMMARY[@]}"; echo "FAILED=$FAILED"\n')
    return subprocess.run(["bash", str(harness)], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("df") is None,
                    reason="needs bash and df")
def test_newest_torch_step_is_reported_not_run_without_the_free_disk_it_needs(tmp_path):
    # More free space asked for than any disk has: the step must not start a venv (an install
    # that runs out of disk half-way is what this guard replaces) and must say why, unfailed.
    r = _newest_torch_harness(tmp_path, ["NEWEST_TORCH_MIN_FREE_GB=100000000 newest_torch"])
    assert r.returncode == 0, r.stderr
    assert "FAILED=0" in r.stdout
    summary = [line for line in r.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert len(summary) == 1 and "newest-torch NOT RUN" in summary[0], r.stdout
    assert "needs 100000000" in summary[0]
    assert not (tmp_path / "build" / "newest-torch" / "venv").exists()


def _gpu_suite_parts(parts):
    script = ROOT / "scripts" / "gpu_suite.sh"
    body = subprocess.run(["sed", "-n", "/^test_paths() {/,/^}/p", str(script)], check=True,
                          capture_output=True, text=True).stdout
    assert body.startswith("test_paths() {"), "scripts/gpu_suite.sh lost its test_paths function"
    return subprocess.run(["bash", "-c", body + '\ntest_paths "$1"', "_", parts], cwd=ROOT,
                          capture_output=True, text=True)


def test_gpu_suite_parts_cover_every_test_file_once():
    # TEST_PART splits tests/ into groups that each fit one device call; together they must be
    # the whole suite, each file in one group, and name only files that exist.
    files = {}
    for part in ("A1", "A2", "B", "C", "D", "E"):
        res = _gpu_suite_parts(part)
        assert res.returncode == 0, res.stderr
        for f in res.stdout.split():
            assert f not in files, f"{f} in parts {files.get(f)} and {part}"
            files[f] = part
    on_disk = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")}
    assert set(files) == on_disk
    assert files["tests/test_dev_scripts.py"] == "E"


@pytest.mark.parametrize("parts", ["A3", "A1 A3"])
def test_gpu_suite_rejects_an_unknown_part(parts):
    res = _gpu_suite_parts(parts)
    assert res.returncode == 2
    assert "A3" in res.stderr and "A1 A2 B C D E" in res.stderr
