#!/usr/bin/python3
"""Print the "rules" section from bench_write_rules' Google Benchmark JSON: per write rule and
path, useful GFLOP/s, the rate as a fraction of the same-binary reference GEMM and of the
Additive rule (both timed in the same iterations as the row), and the targets of issue 19
marked met / NOT met.

Usage: summarize_rules.py RESULTS.json

Each figure is the median over repetitions of a per-repetition ratio, so the machine's speed
changing between rows does not move it. Python 3 standard library only.
"""

import argparse
import json
import statistics
from collections import defaultdict

RULES = ["additive", "additive_l2", "decay", "gated_scalar", "gated_channel", "delta",
         "gated_delta", "gated_delta_channel"]
LABELS = {
    "additive": "Additive (EluPlusOne, strict)",
    "additive_l2": "Additive (L2Normalize, raw)",
    "decay": "Decay(0.95)",
    "gated_scalar": "Gated, scalar gates",
    "gated_channel": "Gated, per-channel gates",
    "delta": "Delta",
    "gated_delta": "GatedDelta",
    "gated_delta_channel": "GatedDelta, per channel (KDA)",
}
PATHS = ["parallel", "recurrent"]
# (rule, path): minimum of the rate as a fraction of Additive's on the same shapes.
TARGETS = {
    ("decay", "parallel"): 0.85,
    ("decay", "recurrent"): 0.85,
    ("gated_scalar", "parallel"): 0.85,
    ("gated_scalar", "recurrent"): 0.85,
    ("gated_channel", "parallel"): 0.5,
    ("delta", "parallel"): 0.5,
    ("delta", "recurrent"): 0.6,
    ("gated_delta", "parallel"): 0.5,
    ("gated_delta", "recurrent"): 0.6,
}
# The delta rules do 6 r dv flops per token against S where Additive does 4.
FLOP_FACTOR = {"delta": 1.5, "gated_delta": 1.5}


def load(path):
    with open(path) as f:
        data = json.load(f)
    reps = defaultdict(list)
    for b in data["benchmarks"]:
        if b.get("run_type") == "aggregate":
            continue
        name = b.get("run_name", b["name"])
        parts = name.split("/")
        if len(parts) < 4 or not parts[0].startswith("BM_"):
            continue
        path = parts[0][3:]
        rule = parts[1]
        reps[(rule, path, int(b["H"]), int(b["d"]))].append(b)
    rows = {}
    for key, rs in reps.items():
        rows[key] = {
            "gflops": statistics.median(r["GFLOP/s"] for r in rs),
            "gemm_frac": statistics.median(r["gemm_frac"] for r in rs),
            "vs_additive": statistics.median(r["vs_additive"] for r in rs),
            "vs_range": (min(r["vs_additive"] for r in rs), max(r["vs_additive"] for r in rs)),
            "gemm": statistics.median(r["gemm_GFLOP/s"] for r in rs),
            "reps": len(rs),
        }
    return data.get("context", {}), rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    args = ap.parse_args()
    ctx, rows = load(args.json)
    if not rows:
        print("rules: no bench_write_rules rows in", args.json)
        return
    heads = sorted({k[2] for k in rows})
    dims = sorted({k[3] for k in rows})
    reps = max(r["reps"] for r in rows.values())
    print("Write rules (bench_write_rules): T = 4096, float, chunk 64, every head its own "
          "columns of [T, H d] buffers")
    print(f"Median of {reps} repetition{'s' if reps > 1 else ''}; per repetition the rule, its "
          "Additive baseline and the reference GEMM are timed in the same iterations.")
    print("Cells: GFLOP/s (4 T H d^2 useful flops per call) | x GEMM | x Additive (rate; "
          "Delta/GatedDelta against Additive with L2Normalize and the unnormalized read)\n")
    for H in heads:
        for d in dims:
            gemm = [r["gemm"] for k, r in rows.items() if k[2] == H and k[3] == d]
            print(f"H = {H}, d = {d}: reference GEMM (64 x {d}) x ({d} x {d}) "
                  f"{statistics.median(gemm):.1f} GFLOP/s")
            print(f"  {'rule':<31}" + "".join(f"{p:>26}" for p in PATHS))
            for rule in RULES:
                cells = []
                for path in PATHS:
                    r = rows.get((rule, path, H, d))
                    if r is None:
                        cells.append(f"{'-':>26}")
                    else:
                        cells.append(f"{r['gflops']:7.1f} | {r['gemm_frac']:4.2f} | "
                                     f"{r['vs_additive']:4.2f}".rjust(26))
                print(f"  {LABELS[rule]:<31}" + "".join(cells))
            print()

    print("Targets (issue 19), rate as a fraction of Additive's on the same shapes:")
    met = total = 0
    for (rule, path), need in TARGETS.items():
        for H in heads:
            for d in dims:
                r = rows.get((rule, path, H, d))
                if r is None:
                    continue
                total += 1
                ok = r["vs_additive"] >= need
                met += ok
                extra = ""
                if rule in FLOP_FACTOR:
                    extra = (f", {FLOP_FACTOR[rule] * r['vs_additive']:.2f} counting 6 r dv "
                             f"flops per token")
                lo, hi = r["vs_range"]
                print(f"  {LABELS[rule]}, {path}, H = {H}, d = {d}: {r['vs_additive']:.2f} x "
                      f"({lo:.2f} to {hi:.2f}{extra}) (target >= {need}) "
                      f"{'met' if ok else 'NOT met'}")
    print(f"  {met} of {total} met")


if __name__ == "__main__":
    main()
