"""Modelled NVIDIA T4 times for the benchmark shapes, from measured H100 / H200 runs and the sm_75
ptxas resources of the kernels (a model, not a measurement: no Turing GPU was available).

    python benchmarks/t4_model.py [--forward benchmarks/results/h200_forward.json]
                                  [--backward benchmarks/results/h200_backward.json]
                                  [--ptxas benchmarks/results/sm75_ptxas.json]
                                  [--decode benchmarks/results/h200_decode.json]

Three parts:

1. Compute model, per measured case (the runs of the kernels as shipped in EXTRA_SOURCES, H100;
   --forward / --backward, H200, for head dims none of those covers, and --no-extra): the kernel
   keeps on a T4 the fraction of the ``mma.sync.m16n8k8`` peak it reached on the stand-in GPU
   (ours / the SM75-instruction ceiling measured in the same run), applied to the T4's 65 TFLOP/s fp16 tensor peak at a sustained clock of
   ``--t4-clock`` GHz out of its 1.59 GHz boost (T4s throttle under sustained load), and it
   cannot beat the DRAM bound: the compulsory traffic (q, k, v, out read/written once; backward:
   also dout, dq, dk, dv) at ``--t4-bandwidth`` GB/s. FLOPs as in the benchmarks (4*B*H*N^2*d,
   halved when causal; backward 2.5x). Per case also: % of the 65 TFLOP/s ceiling, the gap to
   it (65 / model), the warps a T4 SM holds of the kernel and the waves of its grid on 40 SMs;
   then the gap per kernel at the largest measured N of each head dim.
2. Occupancy: CTAs and warps per SM of every shipped kernel on a T4 / RTX 2080 Ti, from the
   registers (ptxas, sm_75) and the threads and shared memory per CTA at launch
   (scripts/check_sm75.py --json), by the rules of ``ctas_per_sm`` in csrc/kernels/launch_plan.h
   (the Python twin below; tests/test_benchmarks.py checks it against that file's gtests).
3. Decode model: a decode call on a T4 takes at least max(K/V bytes / 320 GB/s, the CUDA-core
   FMA work of its CTAs: per key and query row 2 * kD FMAs (q.k and p.v) at 64 FP32 lanes per SM
   x 40 SMs x clock); the modelled share of 320 GB/s per case of the H200 decode sweep and which
   bound applies. Also the bound if every H200 nanosecond of the case had been CUDA-core issue
   (the H200 time x the ratio of CUDA-core rates): a pessimistic bracket.

Why the fractions may carry over, and why they may not: DESIGN.md, "Modelled T4".
"""
import argparse
import json
import pathlib
import re
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks/results"
T4_PEAK_TFLOPS = 65.0
T4_BOOST_GHZ = 1.59
T4_BANDWIDTH_GBS = 320.0
FP32_LANES_PER_SM = 64  # Turing: 64 FP32 FMA lanes per SM
H200_FP32_LANES_PER_SM = 128
H200_SMS = 132
H200_GHZ = 1.98  # the clock the H200 runs reported (nvidia-smi, mma_peak)


# ---- Turing occupancy: a twin of csrc/kernels/launch_plan.h -------------------------------
@dataclass(frozen=True)
class DeviceProfile:
    name: str
    num_sms: int
    smem_per_sm: int
    threads_per_sm: int
    regs_per_sm: int
    max_ctas_per_sm: int
    reserved_smem_per_cta: int = 0  # not in launch_plan.h (0 on Turing); 1 KiB from sm_80 on


# kProfileT4 / kProfileRtx2080Ti (compute capability 7.5): 64 KiB shared memory per SM,
# 1024 threads, 64K registers, 16 CTAs.
PROFILE_T4 = DeviceProfile("t4", 40, 64 * 1024, 1024, 64 * 1024, 16)
PROFILE_RTX2080TI = DeviceProfile("rtx2080ti", 68, 64 * 1024, 1024, 64 * 1024, 16)
# For comparison only (the H200 that measured): sm_90's 228 KiB, 2048 threads, 32 CTAs, 1 KiB
# reserved per CTA. Applied to the sm_75 registers, which the H200's PTX JIT may not keep.
PROFILE_H200_APPROX = DeviceProfile("h200", 132, 228 * 1024, 2048, 64 * 1024, 32, 1024)


def _occupancy_limits(dev, threads, regs_per_thread, smem_per_cta):
    warps = (threads + 31) // 32
    regs_per_warp = ((regs_per_thread if regs_per_thread > 0 else 1) * 32 + 255) // 256 * 256
    limits = {"CTA cap": dev.max_ctas_per_sm,
              "threads": dev.threads_per_sm // (warps * 32),
              "registers": dev.regs_per_sm // regs_per_warp // warps}
    if smem_per_cta > 0 or dev.reserved_smem_per_cta > 0:
        smem = smem_per_cta + dev.reserved_smem_per_cta
        limits["shared memory"] = dev.smem_per_sm // ((smem + 255) // 256 * 256)
    return limits


def ctas_per_sm(dev, threads, regs_per_thread, smem_per_cta):
    """Resident CTAs per SM, as launch_plan.h's ctas_per_sm: registers in units of 256 per
    warp, shared memory (static + dynamic) in units of 256 bytes; 0 when a CTA does not fit.
    (CUDA's occupancy calculator allocates registers per scheduler, 16K each: for CTAs of 4 or
    8 warps, all the kernels here, that gives the same counts.)"""
    if threads <= 0:
        return 0
    return min(_occupancy_limits(dev, threads, regs_per_thread, smem_per_cta).values())


def occupancy_bound(dev, threads, regs_per_thread, smem_per_cta):
    """The resource that sets ctas_per_sm (the first of registers, shared memory, threads, CTA
    cap that reaches the minimum)."""
    limits = _occupancy_limits(dev, threads, regs_per_thread, smem_per_cta)
    n = min(limits.values())
    for name in ("registers", "shared memory", "threads", "CTA cap"):
        if limits.get(name) == n:
            return name


def prefer_small_grid_tile(default_blocks, default_slots, small_blocks, small_slots):
    """launch_plan.h's prefer_small_grid_tile (d = 64 forward)."""
    return (default_slots > 0 and small_slots > 0 and default_blocks > default_slots
            and small_blocks <= small_slots)


DECODE_KEYS_PER_STEP = 128
DECODE_MAX_SPLITS = 64
DECODE_HEAD_DIMS = (64, 128, 256)
HEAD_DIM_BUCKETS = (64, 96, 128, 256)


def head_dim_bucket(d):
    return next((b for b in HEAD_DIM_BUCKETS if d <= b), 0) if d % 8 == 0 and d >= 8 else 0


def decode_head_dim(kd):
    return next((x for x in DECODE_HEAD_DIMS if kd <= x), 0)


def decode_max_heads_per_cta(kd):
    return 16 if kd <= 128 else 8


def plan_decode(b, h, h_k, seqlen_q, seqlen_k, kd, num_sms, enabled=True,
                min_steps_to_split=8, max_multi_rows=0):
    """launch_plan.h's plan_decode: dict(use, ratio_bucket, head_parts, num_splits,
    keys_per_split)."""
    p = dict(use=False, ratio_bucket=0, head_parts=1, num_splits=1,
             keys_per_split=DECODE_KEYS_PER_STEP)
    ratio = h // h_k if h_k > 0 else 0
    if not enabled or seqlen_q < 1 or ratio < 1 or seqlen_k < 1 or kd < 1:
        return p
    rows_per_kv = ratio * seqlen_q
    if seqlen_q > 1 and rows_per_kv > max_multi_rows:
        return p
    p["use"] = True
    cap = decode_max_heads_per_cta(kd)
    rb = 1
    while rb < rows_per_kv and rb < cap:
        rb *= 2
    p["ratio_bucket"] = rb
    p["head_parts"] = -(-rows_per_kv // rb)
    rows = b * h_k * p["head_parts"]
    steps = -(-seqlen_k // DECODE_KEYS_PER_STEP)
    want = -(-4 * num_sms // rows) if num_sms > 0 and steps > min_steps_to_split else 1
    want = max(1, min(want, steps, DECODE_MAX_SPLITS))
    steps_per_split = -(-steps // want)
    p["keys_per_split"] = min(steps_per_split * DECODE_KEYS_PER_STEP, 2**31 - 1)
    p["num_splits"] = -(-steps // steps_per_split)
    return p


# ---- the kernels' sm_75 resources (scripts/check_sm75.py --json) --------------------------
def _variant(path):
    """'plain' | 'causal' | 'local' (+ '_ext') from an instantiation's file name; the bias-only
    ('_bias') and dropout-only ('_dropout') kernels count as extended ones."""
    stem = pathlib.Path(path).stem
    kind = "causal" if "_causal" in stem else "local" if "_local" in stem else "plain"
    narrow = "_ext" in stem or "_bias" in stem or "_dropout" in stem
    return kind + ("_ext" if narrow else "")


class Resources:
    def __init__(self, data):
        self.data = data
        self.kernels = [k for k in data["kernels"] if k["entry"]]

    def find(self, pattern, ext=False, variants=None):
        out = []
        for k in self.kernels:
            v = _variant(k["file"])
            if v.endswith("_ext") != ext or not re.search(pattern, k["name"]):
                continue
            if variants and v.removesuffix("_ext") not in variants:
                continue
            out.append(k)
        return out

    def occupancy(self, pattern, dev=PROFILE_T4, ext=False, variants=None):
        """(threads, smem, regs, ctas, bound) of the most register-hungry match."""
        ks = self.find(pattern, ext, variants)
        if not ks:
            raise KeyError(f"no kernel matches {pattern!r} (ext={ext}, {variants})")
        k = max(ks, key=lambda k: k["registers"])
        smem = k["dynamic_smem"] + k["static_smem"]
        return (k["threads"], smem, k["registers"],
                ctas_per_sm(dev, k["threads"], k["registers"], smem),
                occupancy_bound(dev, k["threads"], k["registers"], smem))


def fwd_pattern(tile):
    return rf"^flash_fwd_kernel<Flash_fwd_kernel_traits<{tile}>,"


# The tile of a plain call at exactly the bucket's head dim (the benchmarks' cases); at d = 256
# the other calls (bias, dropout, score modifiers, windows, packed) run FwdTileD256.
FWD_TILE = {64: "FwdTileD64", 96: "FwdTileD96", 128: "FwdTileD128", 256: "FwdTileD256Wide"}
FWD_TILE_SHAPE = {"FwdTileD64": (64, 64), "FwdTileD64SmallGrid": (64, 32), "FwdTileD96": (128, 64),
                  "FwdTileD128": (128, 64), "FwdTileD256": (64, 32),
                  "FwdTileD256Wide": (128, 16)}  # Br x Bc (kernel_traits.h)
BWD_TRAITS = {64: ("64, 64, 64, 8, 1, true", "64, 64, 4, 1, false, false, false", 64, 64),
              96: ("96, 64, 64, 8, 1, true", "96, 32, 4, 1, false, true, false", 64, 64),
              128: ("128, 32, 64, 8, 1, true", "128, 32, 8, 1, false, true, true", 64, 128),
              256: ("256, 16, 32, 4, 2, false", "256, 16, 4, 2, true, true, false", 32, 32)}
# (dK/dV traits, dQ traits, dK/dV keys per CTA, dQ query rows per CTA): bwd_kernel_traits.h


# The K-in-registers dK/dV tile of the plain deterministic calls without a window
# (Bwd_tile_config::KregTraits, DkdvLaunchTraits::kKregTile): the benchmarks' d = 64 and 128
# cases.
BWD_KREG_TRAITS = {64: "64, 32, 4, 2, true", 128: "128, 16, 4, 2, false"}


def dkdv_pattern(d, atomic=False, kreg=True):
    """The dK/dV kernel of a plain call (kreg: the K-in-registers tile where d has one)."""
    if kreg and not atomic and d in BWD_KREG_TRAITS:
        return rf"^flash_bwd_dkdv_kreg_kernel<Flash_bwd_dkdv_kreg_traits<{BWD_KREG_TRAITS[d]}>,"
    return (rf"^flash_bwd_dkdv_kernel<Flash_bwd_kernel_traits<{BWD_TRAITS[d][0]}>, "
            rf"(true|false), {'true' if atomic else 'false'},")


def dq_pattern(d):
    return rf"^flash_bwd_dq_kernel<Flash_bwd_dq_kernel_traits<{BWD_TRAITS[d][1]}>,"


def decode_pattern(kd, kr):
    return rf"^flash_fwd_decode_kernel<{kd}, {kr},"


def occupancy_rows():
    """(label, pattern) of every shipped kernel, in the table's order."""
    rows = [("forward d=64, 64x64", fwd_pattern("FwdTileD64")),
            ("forward d<=64 small grid, 64x32", fwd_pattern("FwdTileD64SmallGrid")),
            ("forward d=96, 128x64 split", fwd_pattern("FwdTileD96")),
            ("forward d=128, 128x64 split", fwd_pattern("FwdTileD128")),
            ("forward d=256 plain, 128x16", fwd_pattern("FwdTileD256Wide")),
            ("forward d=136-256, 64x32 d-split", fwd_pattern("FwdTileD256"))]
    for d in HEAD_DIM_BUCKETS:
        if d in BWD_KREG_TRAITS:
            rows.append((f"dK/dV d={d}, K in registers", dkdv_pattern(d)))
        rows.append((f"dK/dV d={d}", dkdv_pattern(d, kreg=False)))
        if d != 256:
            rows.append((f"dK/dV d={d}, atomic dQ", dkdv_pattern(d, True)))
        rows.append((f"dQ d={d}", dq_pattern(d)))
    rows.append(("bwd preprocess / dQ convert", r"^flash_bwd_(preprocess|convert_dq)_kernel<"))
    for kd in DECODE_HEAD_DIMS:
        kr = 1
        while kr <= decode_max_heads_per_cta(kd):
            rows.append((f"decode d={kd}, kR={kr}", decode_pattern(kd, kr)))
            kr *= 2
    rows.append(("decode split merge", r"^flash_fwd_decode_merge_kernel<"))
    return rows


def print_occupancy(res):
    g = res.data.get("git", {})
    print(f"\n## Occupancy on Turing (MODEL inputs: sm_75 ptxas registers, threads and shared "
          f"memory per CTA at launch; commit {g.get('commit')}, {res.data.get('nvcc_version')}; "
          f"ctas_per_sm as launch_plan.h; the same on an RTX 2080 Ti, 68 SMs; H200: sm_90's "
          f"limits applied to the same registers, for comparison)")
    print("| kernel | threads | registers | smem KiB | T4 CTAs/SM | T4 warps/SM | bound by | "
          "ext. variant CTAs/SM | slots T4 (40 SMs) / 2080 Ti (68) | H200 CTAs/SM (approx.) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, pattern in occupancy_rows():
        plain = res.find(pattern)
        regs = sorted({k["registers"] for k in plain})
        th, smem, _, ctas, bound = res.occupancy(pattern)
        lo = min(ctas_per_sm(PROFILE_T4, k["threads"], k["registers"],
                             k["dynamic_smem"] + k["static_smem"]) for k in plain)
        ctas_s = f"{ctas}" if lo == ctas else f"{ctas}-{lo}"
        ext = res.find(pattern, ext=True)
        ext_s = "-"
        if ext:
            ext_s = str(min(ctas_per_sm(PROFILE_T4, k["threads"], k["registers"],
                                        k["dynamic_smem"] + k["static_smem"]) for k in ext))
        reg_s = str(regs[0]) if len(regs) == 1 else f"{regs[0]}-{regs[-1]}"
        print(f"| {label} | {th} | {reg_s} | {smem / 1024:.1f} | {ctas_s} | "
              f"{ctas * th // 32} | {bound} | {ext_s} | "
              f"{ctas * PROFILE_T4.num_sms} / {ctas * PROFILE_RTX2080TI.num_sms} | "
              f"{res.occupancy(pattern, PROFILE_H200_APPROX)[3]} |")


# ---- compute model ---------------------------------------------------------------------------
def model(tflops_h200, ceiling_h200, flop, bytes_moved, clock_ghz, bandwidth_gbs):
    """(ms, TFLOP/s, bound) on the modelled T4."""
    frac = tflops_h200 / ceiling_h200
    t_compute = flop / (frac * T4_PEAK_TFLOPS * 1e12 * clock_ghz / T4_BOOST_GHZ)
    t_memory = bytes_moved / (bandwidth_gbs * 1e9)
    t = max(t_compute, t_memory)
    return t * 1e3, flop / t / 1e12, "compute" if t_compute >= t_memory else "memory"


# Runs of the kernels as shipped, beside --forward / --backward (the H200 runs at 30aec69 of the
# d = 64 / 128 kernels as they were then): (pass, results file, file with the run's mma.sync
# ceiling, head dims taken from it, commit). Their rows replace --forward's / --backward's rows of
# those head dims. All are H100 runs (T4 plan, session 46 at 7fdf076; the d = 64 / 128 backward
# is session 45's run of the same kernels, 78d129c, labelled 482eb45 in its JSON before a
# rebase), each case keeping the fraction of the mma.sync ceiling measured on that H100 (the
# backward runs measure none: the forward run's, same machine and session for the d = 96 / 256
# rows, the same H100 model for the d = 64 / 128 rows; the three runs that measured one gave
# 495.7-496.1 TFLOP/s).
EXTRA_SOURCES = [
    ("forward", "h100_fwd_s46.json", "h100_fwd_s46.json", (64, 128), "7fdf076, H100"),
    ("forward", "h100_d80_96_fwd_s46.json", "h100_d80_96_fwd_s46.json", (80, 96),
     "7fdf076, H100"),
    ("forward", "h100_d256_fwd_s46.json", "h100_d256_fwd_s46.json", (256,), "7fdf076, H100"),
    ("backward", "h100_bwd_lseahead_s45.json", "h100_fwd_s46.json", (64, 128), "78d129c, H100"),
    ("backward", "h100_d96_256_bwd_s46.json", "h100_fwd_s46.json", (96, 256), "7fdf076, H100"),
]


def _commit(data):
    c = data.get("commit") or data.get("env", {}).get("git", {}).get("commit") or "?"
    return c[:7]


def model_sources(args):
    """[(pass, cases, ceiling, commit)] for the per-case table."""
    def moved(kind):  # head dims whose rows come from EXTRA_SOURCES instead
        return set() if args.no_extra else {
            d for name, _, _, dims, _ in EXTRA_SOURCES if name == kind for d in dims}

    fwd = json.loads(pathlib.Path(args.forward).read_text())
    out = [("forward", [c for c in fwd["cases"] if c["d"] not in moved("forward")],
            fwd["sm75_ceiling"]["peak_tflops"], _commit(fwd))]
    path = pathlib.Path(args.backward)
    if path.exists():
        bwd = json.loads(path.read_text())
        out.append(("backward", [c for c in bwd["cases"] if c["d"] not in moved("backward")],
                    fwd["sm75_ceiling"]["peak_tflops"], _commit(bwd)))
    if not args.no_extra:
        for name, f, ceil_f, dims, commit in EXTRA_SOURCES:
            data = json.loads((RESULTS / f).read_text())
            ceiling = json.loads((RESULTS / ceil_f).read_text())["sm75_ceiling"]["peak_tflops"]
            out.append((name, [c for c in data["cases"] if c["d"] in dims], ceiling, commit))
    return out


def case_occupancy(res, name, c):
    """(T4 warps per SM, T4 waves, H200 waves with the same CTAs per SM, note) of a case."""
    d, n, grid_bh = head_dim_bucket(c["d"]), c["n"], c["batch"] * c["heads"]
    variants = ("causal",) if c["causal"] else ("plain",)
    if name == "forward":
        tile = FWD_TILE[d]
        note = ""
        if d == 64:  # the small-grid choice: the T4's and the H200's (native plan) may differ
            slots = {t: res.occupancy(fwd_pattern(t), variants=variants)[3]
                     for t in ("FwdTileD64", "FwdTileD64SmallGrid")}
            blocks = -(-n // 64) * grid_bh
            t4 = prefer_small_grid_tile(blocks, slots["FwdTileD64"] * 40, blocks,
                                        slots["FwdTileD64SmallGrid"] * 40)
            h200 = prefer_small_grid_tile(blocks, slots["FwdTileD64"] * H200_SMS, blocks,
                                          slots["FwdTileD64SmallGrid"] * H200_SMS)
            if t4:
                tile = "FwdTileD64SmallGrid"
            if t4 != h200:
                note = "H200 ran the small-grid tile" if h200 else "T4 plan: small-grid tile"
        th, _, _, ctas, _ = res.occupancy(fwd_pattern(tile), variants=variants)
        blocks = -(-n // FWD_TILE_SHAPE[tile][0]) * grid_bh
        return (f"{ctas * th // 32}", blocks / (ctas * 40), blocks / (ctas * H200_SMS), note)
    th, _, _, ctas, _ = res.occupancy(dkdv_pattern(d), variants=variants)
    thq, _, _, ctasq, _ = res.occupancy(dq_pattern(d), variants=variants)
    blocks = -(-n // BWD_TRAITS[d][2]) * grid_bh  # dK/dV grid (h_k = h in the benchmarks)
    return (f"{ctas * th // 32} + {ctasq * thq // 32}", blocks / (ctas * 40),
            blocks / (ctas * H200_SMS), "")


def print_compute(args, res):
    sources = model_sources(args)
    fwd_ceiling = sources[0][2]
    base = f"{args.forward} (commit {sources[0][3]}, ceiling {fwd_ceiling:.1f} TFLOP/s)"
    if args.no_extra:
        what = base
    elif any(cases for _, cases, _, _ in sources[:2]):  # some rows still from the base runs
        what = base + " and the runs in the source column"
    else:
        what = "the runs of the kernels as shipped (source column)"
    print(f"MODEL, not a measurement: T4 at {args.t4_clock} GHz sustained, "
          f"{args.t4_bandwidth:.0f} GB/s; stand-in fractions of the ceiling from {what}")
    print("| pass | d | causal | N | stand-in TFLOP/s (% of ceiling) | T4 model ms "
          "| T4 model TFLOP/s | bound | % of 65 TFLOP/s (gap) | T4 warps/SM "
          "| T4 waves (132 SMs) | source |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    # (pass, our TFLOP/s key, FLOP key, fp16 tensors of B*H*N*d moved through DRAM: forward q,
    #  k, v, out; backward q, k, v, out, dout read and dq, dk, dv written)
    keys = {"forward": ("tflops", "flop", 4), "backward": ("bwd_tflops", "flop_bwd", 8)}
    rows = []
    for name, cases, ceiling, commit in sources:
        tflops_key, flop_key, tensors = keys[name]
        for c in cases:
            ours = c["backends"].get("ours", {}).get(tflops_key)
            if not ours:
                continue
            elems = c["batch"] * c["heads"] * c["n"] * c["d"]
            ms, tf, bound = model(ours, ceiling, c[flop_key], tensors * 2 * elems, args.t4_clock,
                                  args.t4_bandwidth)
            occ = ""
            rows.append(dict(name=name, d=c["d"], causal=c["causal"], n=c["n"], tf=tf,
                             commit=commit, warps=None))
            if res is not None:
                warps, waves, waves_h200, note = case_occupancy(res, name, c)
                rows[-1]["warps"] = warps
                occ = (f" {100 * tf / T4_PEAK_TFLOPS:.1f}% ({T4_PEAK_TFLOPS / tf:.1f}x) | {warps} | "
                       f"{waves:.1f} ({waves_h200:.1f}) | {commit}{', ' + note if note else ''} |")
            print(f"| {name} | {c['d']} | {'yes' if c['causal'] else 'no'} | {c['n']} | "
                  f"{ours:.1f} ({100 * ours / ceiling:.1f}%) | {ms:.3f} | {tf:.1f} | {bound} |"
                  + occ)
    return rows


KERNEL_NAMES = {("forward", 64): "forward 64x64", ("forward", 96): "forward 128x64 split",
                ("forward", 128): "forward 128x64 split", ("forward", 256): "forward 128x16 plain",
                ("backward", 64): "dK/dV + dQ", ("backward", 96): "dK/dV + dQ",
                ("backward", 128): "dK/dV + dQ", ("backward", 256): "dK/dV + dQ, column splits"}


def print_gap_summary(rows):
    """Per (pass, d): the model at the largest measured N, non-causal and causal."""
    print("\n## Gap to the T4 ceiling per kernel (MODEL: the rows above at the largest measured N; "
          f"{T4_PEAK_TFLOPS:.0f} TFLOP/s = 100%)")
    print("| pass | d | kernel (T4 warps/SM) | N | non-causal T4 TFLOP/s, % of 65 (gap) "
          "| causal | source |")
    print("|---|---|---|---|---|---|---|")
    groups = {}
    for r in rows:
        groups.setdefault((r["name"], r["d"]), []).append(r)
    for (name, d), rs in groups.items():
        n = max(r["n"] for r in rs)
        cells = {}
        for r in rs:
            if r["n"] == n:
                cells[r["causal"]] = (f"{r['tf']:.1f}, {100 * r['tf'] / T4_PEAK_TFLOPS:.1f}% "
                                      f"({T4_PEAK_TFLOPS / r['tf']:.1f}x)")
        warps = next((r["warps"] for r in rs if r["warps"]), None)
        kernel = KERNEL_NAMES.get((name, head_dim_bucket(d)), "?")
        print(f"| {name} | {d} | {kernel}{f' ({warps})' if warps else ''} | {n} | "
              f"{cells.get(False, '-')} | {cells.get(True, '-')} | {rs[0]['commit']} |")


# ---- decode model ----------------------------------------------------------------------------
def decode_model(case, res, clock_ghz, bandwidth_gbs):
    """The T4 decode model of one h200_decode.json case (dict)."""
    b, h, h_k, sk, d = case["batch"], case["heads"], case["heads_k"], case["cache"], case["d"]
    kd = decode_head_dim(head_dim_bucket(d))
    plan = plan_decode(b, h, h_k, 1, sk, kd, PROFILE_T4.num_sms)
    kr = plan["ratio_bucket"]
    # FMAs the CTAs issue: every (kv head, head part) CTA row scores kR heads over kD dims
    fma = b * h_k * plan["head_parts"] * kr * sk * 2 * kd
    t_fma = fma / (FP32_LANES_PER_SM * PROFILE_T4.num_sms * clock_ghz * 1e9)
    t_mem = case["kv_bytes"] / (bandwidth_gbs * 1e9)
    t = max(t_fma, t_mem)
    # Pessimistic: the H200 time all CUDA-core issue, scaled by the FP32 rate ratio
    h200_rate = H200_FP32_LANES_PER_SM * H200_SMS * H200_GHZ
    t_issue = case["ours_ms"] * 1e-3 * h200_rate / (FP32_LANES_PER_SM * PROFILE_T4.num_sms
                                                       * clock_ghz)
    out = dict(kd=kd, kr=kr, ctas=b * h_k * plan["head_parts"] * plan["num_splits"],
               t_mem_us=t_mem * 1e6, t_fma_us=t_fma * 1e6,
               bound="memory" if t_mem >= t_fma else "CUDA-core FMA",
               pct_bw=100 * t_mem / t, pct_bw_pessimistic=100 * t_mem / max(t_mem, t_issue),
               h200_pct_copy=case["pct_copy"])
    if res is not None:
        th, _, _, ctas, _ = res.occupancy(decode_pattern(kd, kr))
        out["warps"] = ctas * th // 32
        out["waves"] = out["ctas"] / (ctas * PROFILE_T4.num_sms)
    return out


def print_decode(args, res):
    data = json.loads(pathlib.Path(args.decode).read_text())
    commit = data["env"].get("git", {}).get("commit")
    balance = FP32_LANES_PER_SM * PROFILE_T4.num_sms * args.t4_clock * 1e9 / (
        args.t4_bandwidth * 1e9)
    print(f"\n## Decode on a T4 (MODEL: max(K/V bytes / {args.t4_bandwidth:.0f} GB/s, FMAs / "
          f"({FP32_LANES_PER_SM} lanes x {PROFILE_T4.num_sms} SMs x {args.t4_clock} GHz)); "
          f"cases of {args.decode} (commit {commit}, T4 plan); a group of g q-heads per kv head "
          f"does g / 2 FMAs per K/V byte, the T4 {balance:.1f} per byte: FMA-bound from g = "
          f"{2 * balance:.0f})")
    print("| d | group | B | cache | KV MB | T4 CTAs (waves) | T4 warps/SM | DRAM us | FMA us | "
          "bound | model % of 320 GB/s | if H200 time were all issue | H200 % of copy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for c in data["results"]:
        m = decode_model(c, res, args.t4_clock, args.t4_bandwidth)
        g = summary.setdefault(c["ratio"], dict(fma=0.0, bounds=set(), pess=[]))
        g["fma"] = max(g["fma"], m["t_fma_us"] / m["t_mem_us"])
        g["bounds"].add(m["bound"])
        if m["t_mem_us"] >= args.decode_summary_us:
            g["pess"].append(m["pct_bw_pessimistic"])
        occ = (f"{m['ctas']} ({m['waves']:.1f}) | {m['warps']}" if res is not None
               else f"{m['ctas']} | -")
        print(f"| {c['d']} | {c['ratio']} | {c['batch']} | {c['cache']} | "
              f"{c['kv_bytes'] / 1e6:.1f} | {occ} | {m['t_mem_us']:.1f} | {m['t_fma_us']:.1f} | "
              f"{m['bound']} | {m['pct_bw']:.0f}% | {m['pct_bw_pessimistic']:.0f}% | "
              f"{m['h200_pct_copy']:.0f}% |")
    print(f"Decode summary (MODEL): per group, the bound(s), the FMA time as a share of the DRAM "
          f"time (largest), and the pessimistic bracket over the cases of >= "
          f"{args.decode_summary_us:.0f} us of DRAM time:")
    for ratio, g in sorted(summary.items()):
        pess = (f"{min(g['pess']):.0f}-{max(g['pess']):.0f}% of 320 GB/s" if g["pess"]
                else "no such case")
        print(f"  group {ratio}: {' / '.join(sorted(g['bounds']))}-bound, FMA <= "
              f"{100 * g['fma']:.0f}% of the DRAM time; if the H200 time were all issue: {pess}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--forward", default=str(RESULTS / "h200_forward.json"))
    ap.add_argument("--backward", default=str(RESULTS / "h200_backward.json"))
    ap.add_argument("--ptxas", default=str(RESULTS / "sm75_ptxas.json"),
                    help="scripts/check_sm75.py --json output (with threads / dynamic smem)")
    ap.add_argument("--decode", default=str(RESULTS / "h200_decode.json"),
                    help="bench_decode.py results (T4 plan)")
    ap.add_argument("--no-extra", action="store_true",
                    help="only --forward / --backward in the per-case table (no head-dim runs)")
    ap.add_argument("--decode-summary-us", type=float, default=1000.0,
                    help="decode summary: cases with at least this DRAM time on the T4 (us)")
    ap.add_argument("--t4-clock", type=float, default=1.3, help="sustained GHz (boost 1.59)")
    ap.add_argument("--t4-bandwidth", type=float, default=T4_BANDWIDTH_GBS, help="GB/s")
    args = ap.parse_args()

    path = pathlib.Path(args.ptxas)
    res = Resources(json.loads(path.read_text())) if path.exists() else None
    rows = print_compute(args, res)
    print_gap_summary(rows)
    if res is not None:
        print_occupancy(res)
    if pathlib.Path(args.decode).exists():
        print_decode(args, res)


if __name__ == "__main__":
    main()
