#!/usr/bin/python3
"""Summarize bench_gradients' Google Benchmark JSON: what training costs next to the forward.

Usage: summarize_gradients.py RESULTS.json

Prints, for the chunked causal path (float, ELU + 1, default chunk):
  - backward / forward and (forward + backward) / forward per d, T, heads and threads: each
    repetition measures both phases in the same iterations (bench_gradients.cpp), and the figure
    is the median over repetitions of that paired ratio;
  - the scaling t(16384) / t(2048) of the backward, judged on the paired `scaling` row
    (both lengths timed in every iteration), with the ratio of separate rows beside it;
  - the targets of issue 14: backward <= 2.5 x forward, scaling within 10% of 8;
  - the saved-forward design (train_saved rows): the saving forward, the backward from its
    saved states and the recomputing backward against the plain forward, all four timed in
    the same iterations, with the saved states' bytes per token; and the target line for both
    designs (backward / forward: recomputing, and from a saved forward);
  - the same four phases through the multi-head layer (train_layer rows: 8 heads in a
    model's [1, T, 8, d] buffers, the layer's saved forward against its recomputing backward);
  - the crossover against the quadratic (T x T) backward of the same shapes;
  - the backward's memory per token at T = 65,536, d = 128.
Standard library only (json), so it runs wherever the benchmark does.
"""

import json
import statistics
import sys
from collections import defaultdict

BWD_TARGET = 2.5
SCALING_TARGET = 8.0
SCALING_TOLERANCE = 0.10


def load(path):
    with open(path) as f:
        data = json.load(f)
    rows = defaultdict(list)
    for b in data["benchmarks"]:
        if b.get("run_type") == "aggregate":
            continue
        rows[b.get("run_name", b["name"])].append(b)
    return data.get("context", {}), rows


def parse_name(name):
    parts = name.split("/")
    fields = {"kind": parts[0]}
    for part in parts[1:]:
        if ":" in part:
            key, value = part.split(":", 1)
            if value.isdigit():
                fields[key] = int(value)
    return fields


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        sys.exit(2)
    context, rows = load(sys.argv[1])
    train, quadratic, memory, scaling, saved, layer = {}, {}, {}, {}, {}, {}
    for name, reps in rows.items():
        f = parse_name(name)
        if f["kind"] == "train":
            key = (f["d"], f["T"], f["heads"], f["threads"])
            train[key] = {
                "ratio": statistics.median(r["bwd_over_fwd"] for r in reps),
                "step": statistics.median(r["step_over_fwd"] for r in reps),
                "fwd": min(r["fwd_ms"] for r in reps),
                "bwd": min(r["bwd_ms"] for r in reps),
                "reps": len(reps),
                "scratch": reps[0]["scratch_B/token"],
            }
        elif f["kind"] in ("train_saved", "train_layer"):
            med = lambda k: statistics.median(r[k] for r in reps)
            target = saved if f["kind"] == "train_saved" else layer
            target[(f["d"], f["T"])] = {
                "fwd": min(r["fwd_ms"] for r in reps),
                "save": min(r["save_fwd_ms"] for r in reps),
                "bwd": min(r["bwd_ms"] for r in reps),
                "recompute": min(r["recompute_ms"] for r in reps),
                "ratio": med("bwd_over_fwd"),
                "save_ratio": med("save_over_fwd"),
                "step": med("step_over_fwd"),
                "recompute_ratio": med("recompute_over_fwd"),
                "recompute_step": med("recompute_step_over_fwd"),
                "saved_bytes": reps[0]["saved_B/token"],
                "scratch": reps[0].get("scratch_B/token"),
            }
        elif f["kind"] == "quadratic_bwd":
            quadratic[(f["d"], f["T"])] = min(r["bwd_ms"] for r in reps)
        elif f["kind"] == "scaling":
            scaling[f["d"]] = statistics.median(r["scaling"] for r in reps)
        elif f["kind"] == "memory":
            memory[(f["d"], f["T"])] = reps[0]

    print("## Gradients: backward of the chunked causal path (bench_gradients)")
    host = context.get("host_name", "?")
    print(f"{context.get('date', '?')} on {host}, {context.get('num_cpus', '?')} CPUs; "
          "float, ELU + 1, strict, chunk 32; medians of paired ratios over repetitions")
    print()
    print(f"{'d':>4} {'T':>6} {'heads':>5} {'thr':>3} {'fwd ms':>9} {'bwd ms':>9} "
          f"{'bwd/fwd':>8} {'(f+b)/f':>8} {'scratch B/tok':>13}")
    for key in sorted(train):
        d, T, heads, threads = key
        r = train[key]
        print(f"{d:>4} {T:>6} {heads:>5} {threads:>3} {r['fwd']:>9.2f} {r['bwd']:>9.2f} "
              f"{r['ratio']:>8.2f} {r['step']:>8.2f} {r['scratch']:>13.1f}")

    print()
    print(f"Targets: backward <= {BWD_TARGET} x forward; backward t(16384) / t(2048) within "
          f"{SCALING_TOLERANCE:.0%} of {SCALING_TARGET:g}")
    groups = sorted({(d, heads, threads) for d, _, heads, threads in train})
    for d, heads, threads in groups:
        big, small = train.get((d, 16384, heads, threads)), train.get((d, 2048, heads, threads))
        ratios = [train[k]["ratio"] for k in train
                  if k[0] == d and k[2] == heads and k[3] == threads and k[1] >= 2048]
        line = f"  d = {d:>3}, {heads} head(s), {threads} thread(s): "
        if ratios:
            worst = max(ratios)
            line += (f"bwd/fwd {min(ratios):.2f} to {worst:.2f} "
                     f"({'met' if worst <= BWD_TARGET else 'missed'})")
        if big and small:
            line += f"; t(16384)/t(2048) {big['bwd'] / small['bwd']:.2f} from separate rows"
        print(line)
    for d, ratio in sorted(scaling.items()):
        ok = abs(ratio / SCALING_TARGET - 1) <= SCALING_TOLERANCE
        print(f"  d = {d:>3}, backward t(16384)/t(2048) paired in one row: {ratio:.2f} "
              f"({'met' if ok else 'missed'})")

    if saved:
        print()
        print("## The saved-forward design (train_saved: four phases timed in every iteration, "
              "one head, one thread)")
        print("saving forward + backward from its states, against the plain forward and the "
              "recomputing backward of the same iterations")
        print()
        print(f"{'d':>4} {'T':>6} {'fwd ms':>8} {'save ms':>8} {'bwd ms':>8} {'recomp ms':>9} "
              f"{'save/fwd':>8} {'bwd/fwd':>8} {'recomp/fwd':>10} {'(s+b)/f':>8} "
              f"{'(f+r)/f':>8} {'saved B/tok':>11} {'scratch B/tok':>13}")
        for (d, T) in sorted(saved):
            r = saved[(d, T)]
            print(f"{d:>4} {T:>6} {r['fwd']:>8.2f} {r['save']:>8.2f} {r['bwd']:>8.2f} "
                  f"{r['recompute']:>9.2f} {r['save_ratio']:>8.2f} {r['ratio']:>8.2f} "
                  f"{r['recompute_ratio']:>10.2f} {r['step']:>8.2f} {r['recompute_step']:>8.2f} "
                  f"{r['saved_bytes']:>11.1f} {r['scratch']:>13.1f}")
        print()
        print(f"Target backward <= {BWD_TARGET} x forward, both designs (paired in the same "
              "iterations):")
        for d in sorted({d for d, _ in saved}):
            rows = [saved[k] for k in saved if k[0] == d]
            for label, key in (("recomputing backward", "recompute_ratio"),
                               ("backward from a saved forward", "ratio")):
                vals = [r[key] for r in rows]
                worst = max(vals)
                print(f"  d = {d:>3}, {label}: bwd/fwd {min(vals):.2f} to {worst:.2f} "
                      f"({'met' if worst <= BWD_TARGET else 'missed'})")
            steps = [r["step"] for r in rows]
            rsteps = [r["recompute_step"] for r in rows]
            print(f"  d = {d:>3}, whole step / plain forward: saved design {min(steps):.2f} to "
                  f"{max(steps):.2f}, recomputing design {min(rsteps):.2f} to {max(rsteps):.2f}")

    if layer:
        print()
        print("## The multi-head layer (train_layer: MultiHeadAttention, 8 heads in [1, T, 8, d] "
              "buffers, one thread; the same four phases)")
        print()
        print(f"{'d':>4} {'T':>6} {'fwd ms':>8} {'save ms':>8} {'bwd ms':>8} {'recomp ms':>9} "
              f"{'save/fwd':>8} {'bwd/fwd':>8} {'recomp/fwd':>10} {'(s+b)/f':>8} "
              f"{'(f+r)/f':>8} {'saved B/tok':>11}")
        for (d, T) in sorted(layer):
            r = layer[(d, T)]
            print(f"{d:>4} {T:>6} {r['fwd']:>8.2f} {r['save']:>8.2f} {r['bwd']:>8.2f} "
                  f"{r['recompute']:>9.2f} {r['save_ratio']:>8.2f} {r['ratio']:>8.2f} "
                  f"{r['recompute_ratio']:>10.2f} {r['step']:>8.2f} {r['recompute_step']:>8.2f} "
                  f"{r['saved_bytes']:>11.1f}")
        for d in sorted({d for d, _ in layer}):
            rows = [layer[k] for k in layer if k[0] == d]
            steps = [r["step"] for r in rows]
            rsteps = [r["recompute_step"] for r in rows]
            print(f"  d = {d:>3}, whole step / plain forward: layer's saved forward "
                  f"{min(steps):.2f} to {max(steps):.2f}, recomputing {min(rsteps):.2f} to "
                  f"{max(rsteps):.2f}")

    if quadratic:
        print()
        print("Quadratic (T x T) backward against the chunked backward, one head, ms:")
        for d in sorted({d for d, _ in quadratic}):
            crossover = None
            cells = []
            for T in sorted(T for dd, T in quadratic if dd == d):
                q = quadratic[(d, T)]
                c = train.get((d, T, 1, 1))
                if c is None:
                    continue
                cells.append(f"T={T}: {q:.2f} vs {c['bwd']:.2f}")
                if crossover is None and c["bwd"] < q:
                    crossover = T
            where = (f"chunked faster from T = {crossover}" if crossover
                     else "quadratic faster over the measured range")
            print(f"  d = {d}: {'; '.join(cells)} -> {where}")

    for (d, T), r in sorted(memory.items()):
        print()
        print(f"Memory, one backward at T = {T}, d = {d}: peak {r['peak_MiB']:.1f} MiB measured, of "
              f"which {r['gradients_MiB']:.1f} MiB are the returned dQ, dK, dV; the backward's "
              f"own {r['own_MiB']:.2f} MiB measured (resolution ~1 MiB), "
              f"{r['scratch_MiB']:.2f} MiB = {r['scratch_B/token']:.1f} B/token computed")


if __name__ == "__main__":
    main()
