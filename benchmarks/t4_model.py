"""Modelled NVIDIA T4 times for the benchmark shapes, from a measured H200 run (a model, not a
measurement: no Turing GPU was available).

    python benchmarks/t4_model.py [--forward benchmarks/results/h200_forward.json]
                                  [--backward benchmarks/results/h200_backward.json]

Model, per case: the kernel keeps on a T4 the fraction of the ``mma.sync.m16n8k8`` peak it
reached on the H200 (ours / the SM75-instruction ceiling measured in the same H200 run), applied
to the T4's 65 TFLOP/s fp16 tensor peak at a sustained clock of ``--t4-clock`` GHz out of its
1.59 GHz boost (T4s throttle under sustained load), and it cannot beat the DRAM bound: the
compulsory traffic (q, k, v, out read/written once; backward: also dout, dq, dk, dv) at
``--t4-bandwidth`` GB/s. FLOPs as in the benchmarks (4*B*H*N^2*d, halved when causal;
backward 2.5x). Why the fraction may carry over, and why it may not: DESIGN.md, "Modelled T4".
"""
import argparse
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
T4_PEAK_TFLOPS = 65.0
T4_BOOST_GHZ = 1.59


def model(tflops_h200, ceiling_h200, flop, bytes_moved, clock_ghz, bandwidth_gbs):
    """(ms, TFLOP/s, bound) on the modelled T4."""
    frac = tflops_h200 / ceiling_h200
    t_compute = flop / (frac * T4_PEAK_TFLOPS * 1e12 * clock_ghz / T4_BOOST_GHZ)
    t_memory = bytes_moved / (bandwidth_gbs * 1e9)
    t = max(t_compute, t_memory)
    return t * 1e3, flop / t / 1e12, "compute" if t_compute >= t_memory else "memory"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--forward", default=str(ROOT / "benchmarks/results/h200_forward.json"))
    ap.add_argument("--backward", default=str(ROOT / "benchmarks/results/h200_backward.json"))
    ap.add_argument("--t4-clock", type=float, default=1.3, help="sustained GHz (boost 1.59)")
    ap.add_argument("--t4-bandwidth", type=float, default=320.0, help="GB/s")
    args = ap.parse_args()

    fwd = json.loads(pathlib.Path(args.forward).read_text())
    ceiling = fwd["sm75_ceiling"]["peak_tflops"]
    commit = fwd["env"].get("git", {}).get("commit")
    print(f"MODEL, not a measurement: T4 at {args.t4_clock} GHz sustained, "
          f"{args.t4_bandwidth:.0f} GB/s; H200 fractions from {args.forward} (commit {commit}, "
          f"ceiling {ceiling:.1f} TFLOP/s)")
    print("| pass | d | causal | N | H200 TFLOP/s (% of ceiling) | T4 model ms | T4 model TFLOP/s "
          "| bound |")
    print("|---|---|---|---|---|---|---|---|")
    # (pass, cases, our TFLOP/s key, FLOP key, fp16 tensors of B*H*N*d moved through DRAM:
    #  forward q, k, v, out; backward q, k, v, out, dout read and dq, dk, dv written)
    passes = [("forward", fwd["cases"], "tflops", "flop", 4)]
    path = pathlib.Path(args.backward)
    if path.exists():
        passes.append(("backward", json.loads(path.read_text())["cases"], "bwd_tflops",
                       "flop_bwd", 8))
    for name, cases, tflops_key, flop_key, tensors in passes:
        for c in cases:
            ours = c["backends"].get("ours", {}).get(tflops_key)
            if not ours:
                continue
            elems = c["batch"] * c["heads"] * c["n"] * c["d"]
            ms, tf, bound = model(ours, ceiling, c[flop_key], tensors * 2 * elems, args.t4_clock,
                                  args.t4_bandwidth)
            print(f"| {name} | {c['d']} | {'yes' if c['causal'] else 'no'} | {c['n']} | "
                  f"{ours:.1f} ({100 * ours / ceiling:.1f}%) | {ms:.3f} | {tf:.1f} | {bound} |")


if __name__ == "__main__":
    main()
