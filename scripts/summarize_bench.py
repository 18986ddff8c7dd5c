#!/usr/bin/python3
"""Summarize bench_paths' Google Benchmark JSON: a table per head size, the crossovers, the
targets of docs/performance.md, and optionally a log-log plot of time per call against T.

Usage: summarize_bench.py RESULTS.json [--plot OUT.png]

With repetitions, each figure is the best repetition (shortest time): on a machine shared with
other work, the least disturbed run is the closest to the hardware's speed. Ratios (% of GEMM,
speed-ups) compare rows of the same run; % of GEMM is computed here from the best GEMM row.
The targets are judged on the paired ratio where the row has one: the median over repetitions
of the row's GFLOP/s over the reference GEMM's timed right after it in the same iterations,
which does not move with the machine's speed between rows.
"""

import statistics

import argparse
import json
import platform
import re
import subprocess
from collections import defaultdict

PATHS = ["chunked", "recurrent", "decode", "decode_interleaved", "quadratic", "softmax"]
LINEAR = ["chunked", "recurrent", "decode"]


def counter_row(path, d, T, reps, **counters):
    """A row of a benchmark that reports counters instead of a rate (long_T, decode_choice):
    the keys every row has, at neutral values (one thread, no rate, not paired), then its own."""
    return {"path": path, "d": d, "T": T, "threads": 1, "chunk": 0, "gflops": 0.0, "ms": 0.0,
            "real_ms": 0.0, "paired": [], "reps": reps, "tokens": 0.0, **counters}


def load(path):
    with open(path) as f:
        data = json.load(f)
    runs = defaultdict(list)
    for b in data["benchmarks"]:
        if b.get("run_type") == "aggregate":
            continue
        base = b.get("run_name", b["name"])
        runs[base].append(b)
    rows = {}
    for name, reps in runs.items():
        path = name.split("/")[0]
        first = reps[0]
        if path.startswith("long_T"):
            # Per-token time against T (bench_paths.cpp, BM_long_T).
            rows[name] = counter_row(
                path, int(first["d"]), 0, len(reps),
                long={k: min(r[k] for r in reps) for k in first if k.startswith("ns/token@")},
                flat=min(r["flat"] for r in reps),
                long_over_short=min(r["long_over_short"] for r in reps))
            continue
        if path.startswith("decode_choice"):
            # The fused and deferred decode steps timed in the same iterations
            # (bench_paths.cpp, BM_decode_choice): per repetition, the medians of both times and
            # of their ratio.
            rows[name] = counter_row(
                path, int(first["d"]), int(first["T"]), len(reps),
                fused_ms=statistics.median(r["fused_ms"] for r in reps),
                deferred_ms=statistics.median(r["deferred_ms"] for r in reps),
                deferred_over_fused=sorted(r["deferred_over_fused"] for r in reps))
            continue
        row = {
            "path": path,
            "T": int(first.get("T", 0)),
            "d": int(first["d"]),
            "threads": int(first["threads"]),
            "chunk": int(first.get("chunk", 0)),
            "ms": min(r["real_time"] if "real_time" in name else r["cpu_time"] for r in reps),
            "real_ms": min(r["real_time"] for r in reps),
            "gflops": max(r["GFLOP/s"] for r in reps),
            "tokens": max(r.get("tokens/s", 0.0) for r in reps),
            "reps": len(reps),
            # Per repetition: useful GFLOP/s over the reference GEMM's, timed in the same
            # iterations (bench_paths.cpp, paired_row); empty for rows that are not paired.
            "paired": sorted(r["paired_frac"] for r in reps if "paired_frac" in r),
        }
        # Google Benchmark reports in the row's unit (ms here); keep ms.
        rows[name] = row
    return data.get("context", {}), list(rows.values())


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        m = re.search(r"Model name:\s*(.+)", out)
        return m.group(1).strip() if m else platform.processor()
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"


def si(x):
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def pick(rows, **kw):
    return [r for r in rows if all(r[k] == v for k, v in kw.items())]


def one(rows, **kw):
    found = pick(rows, **kw)
    return found[0] if found else None


def first_win(rows, d, fast, slow):
    """Smallest T from which `fast` is faster than `slow` at every measured T (1 thread)."""
    Ts = sorted({r["T"] for r in pick(rows, path=fast, d=d, threads=1)}
                & {r["T"] for r in pick(rows, path=slow, d=d, threads=1)})
    if not Ts:
        return "not measured"
    wins = [one(rows, path=fast, d=d, threads=1, T=T)["ms"] <
            one(rows, path=slow, d=d, threads=1, T=T)["ms"] for T in Ts]
    if all(wins):
        return f"at every T measured (from T = {Ts[0]})"
    if not wins[-1]:
        return f"at no T up to {Ts[-1]}" if not any(wins) else \
            f"only at some T ({', '.join(str(T) for T, w in zip(Ts, wins) if w)})"
    k = len(wins)
    while k > 0 and wins[k - 1]:
        k -= 1
    return f"from T = {Ts[k]} (slower at T = {Ts[k - 1]})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    ctx, rows = load(args.json)
    main_rows = [r for r in rows if r["path"] in PATHS]
    gemm = {(r["d"], r["threads"]): r["gflops"] for r in rows if r["path"] == "gemm"}
    for r in rows:
        ref = gemm.get((r["d"], r["threads"]))
        r["frac"] = r["gflops"] / ref if ref else float("nan")
    dims = sorted({r["d"] for r in main_rows})

    print(f"Machine: {cpu_model()}, {ctx.get('num_cpus', '?')} CPUs, "
          f"binary built for {ctx.get('simd_isa', '?')}; float, H = {ctx.get('heads', 8)} heads, "
          f"sweep: {ctx.get('sweep', '?')}")
    if ctx.get("load_avg"):
        print(f"Load average when the run started: {', '.join(f'{x:.2f}' for x in ctx['load_avg'])}"
              " (other processes share the cores; 1-thread rows use thread CPU time)")
    if ctx.get("l1d_bytes"):
        vendor = f", {ctx['cpu_vendor']} core" if ctx.get("cpu_vendor") else ""
        print(f"Defaults chosen at run time for this machine (L1 data cache "
              f"{int(ctx['l1d_bytes']) // 1024} KiB{vendor}): chunk size "
              + ", ".join(f"{ctx.get(f'default_chunk_size_d{d}', '?')} at d = {d}" for d in dims)
              + "; decode block "
              + ", ".join(f"{ctx.get(f'default_decode_block_d{d}', '?')} at d = {d}" for d in dims)
              + " (0 = the fused step)")
    reps = max(r["reps"] for r in rows)
    print(f"Each row: best of {reps} repetition{'s' if reps > 1 else ''}.")
    print("Cells: tokens/s over all heads, and useful GFLOP/s (4 T H d^2 per call) as % of the "
          "same-binary GEMM rate.\n")

    for d in dims:
        for threads in (1, 2):
            sel = pick(main_rows, d=d, threads=threads)
            if not sel:
                continue
            Ts = sorted({r["T"] for r in sel})
            ref = gemm.get((d, threads))
            ref_txt = f"{ref:.1f} GFLOP/s" if ref else "not measured"
            print(f"d = {d}, {threads} thread{'s' if threads > 1 else ''}: reference GEMM "
                  f"(64 x {d}) x ({d} x {d}) at {ref_txt}")
            header = f"  {'path':<19}" + "".join(f"{'T=' + str(T):>17}" for T in Ts)
            print(header)
            for path in PATHS:
                cells = []
                any_cell = False
                for T in Ts:
                    r = one(sel, path=path, T=T)
                    if r is None:
                        cells.append(f"{'-':>17}")
                    else:
                        any_cell = True
                        cells.append(f"{si(r['tokens']):>9} {100 * r['frac']:5.1f}%"[:17].rjust(17))
                if any_cell:
                    print(f"  {path:<19}" + "".join(cells))
            print()

    print("Crossovers (1 thread, time per call):")
    for d in dims:
        print(f"  d = {d}: chunked beats recurrent {first_win(main_rows, d, 'chunked', 'recurrent')}; "
              f"chunked (linear) beats softmax {first_win(main_rows, d, 'chunked', 'softmax')}; "
              f"recurrent beats softmax {first_win(main_rows, d, 'recurrent', 'softmax')}")
    print()

    print("Targets (docs/performance.md), 1 thread at T = 4096 unless noted:")

    def check(ok):
        return "met" if ok else "NOT met"

    def target(path, d, need, T=4096):
        r = one(main_rows, path=path, d=d, threads=1, T=T)
        if not r:
            print(f"  {path}, d = {d}: not measured")
            return
        paired = r["paired"]
        if paired:
            median = statistics.median(paired)
            print(f"  {path}, d = {d}: {median:.2f} x GEMM paired (median of {len(paired)}, "
                  f"{paired[0]:.2f} to {paired[-1]:.2f}; best rows {r['frac']:.2f}) "
                  f"(target >= {need}) {check(median >= need)}")
        else:
            print(f"  {path}, d = {d}: {r['frac']:.2f} x GEMM (target >= {need}) "
                  f"{check(r['frac'] >= need)}")

    for d, need in ((128, 0.65), (64, 0.5)):
        target("chunked", d, need)
    for path in ("recurrent", "decode"):
        for d, need in ((64, 0.5), (128, 0.45)):
            target(path, d, need)
    # Variants of the decode rows, each against the plain row of the same order and d: the
    # same steps writing into one reused output row, as a model's decode does (what the cold
    # output lines of the [T, H d] buffer cost the plain rows).
    variants = (
        ("_hot_out", lambda order, d, base, var:
            f"  decode ({order}) into one reused output row, d = {d}: {var['frac']:.2f} x GEMM, "
            f"{base['ms'] / var['ms']:.2f} x as fast as into row t of [T, H d]"),
    )
    for suffix, line in variants:
        for order, path in (("each head alone", "decode"),
                            ("heads taking turns", "decode_interleaved")):
            for d in dims:
                base = one(rows, path=path, d=d, threads=1, T=4096)
                var = one(rows, path=path + suffix, d=d, threads=1, T=4096)
                if base and var:
                    print(line(order, d, base, var))
    for d in dims:
        # The same decode with the Identity map on |q|, |k|: what the step costs without the
        # ELU+1 exponentials, i.e. how much of the gap to the decode target the map accounts for.
        plain = one(rows, path="decode_identity", d=d, threads=1, T=4096)
        elu = one(main_rows, path="decode", d=d, threads=1, T=4096)
        if plain and elu:
            print(f"  decode without the exponentials (Identity map), d = {d}: "
                  f"{plain['frac']:.2f} x GEMM; ELU+1's share of a decode token: "
                  f"{100 * (1 - plain['ms'] / elu['ms']):.0f}% (two rows timed apart: the "
                  "share moves with the machine's speed between them)")
    for path in ("chunked", "recurrent", "decode"):
        for d in dims:
            a = one(main_rows, path=path, d=d, threads=1, T=2048)
            b = one(main_rows, path=path, d=d, threads=1, T=16384)
            if a and b and a["paired"] and b["paired"]:
                # Each length's time in units of the GEMM timed beside it: time is T / (rate),
                # rate = paired fraction x GEMM rate, so the ratio is 8 x f(2048) / f(16384).
                ratio = 8 * statistics.median(a["paired"]) / statistics.median(b["paired"])
                print(f"  scaling {path}, d = {d}: time(16384) / time(2048) = {ratio:.2f} "
                      f"paired (best rows {b['ms'] / a['ms']:.2f}) "
                      f"(target 8 +- 10%) {check(abs(ratio / 8 - 1) <= 0.1)}")
            elif a and b:
                ratio = b["ms"] / a["ms"]
                print(f"  scaling {path}, d = {d}: time(16384) / time(2048) = {ratio:.2f} "
                      f"(target 8 +- 10%) {check(abs(ratio / 8 - 1) <= 0.1)}")
    for path in ("chunked", "recurrent", "decode"):
        for d in dims:
            Ts = sorted({r["T"] for r in pick(main_rows, path=path, d=d, threads=2)})
            if not Ts:
                continue
            T = 4096 if 4096 in Ts else Ts[-1]
            one_t = one(main_rows, path=path, d=d, threads=1, T=T)
            two_t = one(main_rows, path=path, d=d, threads=2, T=T)
            if one_t and two_t:
                # Both in wall-clock time: the 1-thread row's CPU time would flatter it when the
                # machine is shared.
                s = one_t["real_ms"] / two_t["real_ms"]
                print(f"  2 threads over heads, {path}, d = {d}, T = {T}: {s:.2f} x 1 thread "
                      f"(target >= 1.8) {check(s >= 1.8)}")
    for d in dims:
        st = one(rows, path="stream", d=d)
        if st:
            best = max((one(main_rows, path=p, d=d, threads=1, T=4096) or {"gflops": 0})["gflops"]
                       for p in ("recurrent", "decode"))
            print(f"  roofline d = {d}: a pure read-modify-write sweep over S (no read of y) runs "
                  f"at {st['gflops']:.1f} GFLOP/s-equivalent = {st['frac']:.2f} x GEMM; the best "
                  f"token-serial path reaches {best / st['gflops']:.2f} of it")
    gemm_real = {(r["d"], r["threads"]): r["real_ms"] for r in rows if r["path"] == "gemm"}
    gemm_scale = [gemm_real[(d, 1)] / gemm_real[(d, 2)] for d in dims
                  if (d, 2) in gemm_real and (d, 1) in gemm_real]
    if gemm_scale:
        print("  (the reference GEMM itself scales by "
              + ", ".join(f"{x:.2f}" for x in gemm_scale) + " on 2 threads in this run, wall-clock)")
    print()

    print_choices(rows, dims, ctx)
    print_layouts(rows, dims)

    sweep = [r for r in rows if r["path"] == "chunk_size"]
    if sweep:
        print("Chunk size sweep (T = 4096, 1 thread): useful GFLOP/s by chunk size")
        for d in dims:
            sel = sorted(pick(sweep, d=d), key=lambda r: r["chunk"])
            best = max(sel, key=lambda r: r["gflops"])
            print(f"  d = {d}: " + ", ".join(f"C={r['chunk']}: {r['gflops']:.1f}" for r in sel)
                  + f"  -> fastest C = {best['chunk']}")

    if args.plot:
        plot(main_rows, dims, args.plot, ctx)


def print_choices(rows, dims, ctx):
    """The run-time defaults beside their alternatives, measured in this run (T = 4096, one
    thread): the decode block (the fused step B = 1 against the deferred B = 16, timed in the
    same iterations, in both decode orders) and the chunk size (default against the fastest of
    the sweep). Target (issue 19): the decode default within 5% of the better alternative."""
    print("Run-time choices against their alternatives (T = 4096, 1 thread, time per call):")
    for order, path in (("each head alone", "decode_choice"),
                        ("heads taking turns", "decode_choice_interleaved")):
        for d in dims:
            r = one(rows, path=path, d=d, threads=1, T=4096)
            if not r:
                continue
            block = ctx.get(f"default_decode_block_d{d}", "?")
            # The default is one of the two steps (block 0 or 1: the fused step; 16: the
            # deferred one). Its speed over the better one's is judged on the paired ratio:
            # deferred time / fused time measured in the same iterations, the median over
            # repetitions (each repetition's own median over its iterations).
            ratios = r["deferred_over_fused"]
            median = statistics.median(ratios)
            name = {"0": "fused", "1": "fused", "16": "deferred"}.get(str(block))
            spread = f"median of {len(ratios)}, {ratios[0]:.2f} to {ratios[-1]:.2f}"
            line = (f"  decode ({order}), d = {d}: fused {r['fused_ms']:.2f} ms, deferred (16) "
                    f"{r['deferred_ms']:.2f} ms; deferred / fused time {median:.2f} paired "
                    f"({spread})")
            if name is None:
                print(line + f"; default block {block} is neither step: not judged")
                continue
            ratio = min(1.0, median if name == "fused" else 1.0 / median)
            print(line + f": the default (block {block}, {name}) {ratio:.2f} x as fast as the "
                  f"better (target >= 0.95) {'met' if ratio >= 0.95 else 'NOT met'}")
    sweep = [r for r in rows if r["path"] == "chunk_size"]
    for d in dims:
        chosen = ctx.get(f"default_chunk_size_d{d}")
        sel = pick(sweep, d=d)
        if not chosen or not sel:
            continue
        best = max(sel, key=lambda r: r["gflops"])
        mine = [r for r in sel if r["chunk"] == int(chosen)]
        if mine:
            print(f"  chunk size, d = {d}: default C = {chosen} at {mine[0]['gflops']:.1f} GFLOP/s, "
                  f"fastest C = {best['chunk']} at {best['gflops']:.1f}: default "
                  f"{mine[0]['gflops'] / best['gflops']:.2f} of the fastest")
    print()


def print_layouts(rows, dims):
    """The chunked and recurrent paths over the two buffer layouts a model uses (every head its
    own data): token-major [T, H d] (the main table) and head-major [H, T, d]; and the time per
    token from T = 4096 to 16384, which stays flat when the inputs stream well."""
    lines = []
    for path in ("chunked", "recurrent"):
        for d in dims:
            cells = []
            for T in (4096, 16384):
                tm = one(rows, path=path, d=d, threads=1, T=T)
                hf = one(rows, path=path + "_head_first", d=d, threads=1, T=T)
                if tm and hf:
                    cells.append(f"T = {T}: {tm['gflops']:.1f} token-major, {hf['gflops']:.1f} "
                                 f"head-major")
            tm4, tm16 = (one(rows, path=path, d=d, threads=1, T=T) for T in (4096, 16384))
            if cells and tm4 and tm16:
                growth = (tm16["ms"] / 16384) / (tm4["ms"] / 4096)
                lines.append(f"  {path}, d = {d}: " + "; ".join(cells)
                             + f" GFLOP/s; time per token T = 16384 over T = 4096: {growth:.2f}")
    if lines:
        print("Layouts (1 thread, every head its own data):")
        for line in lines:
            print(line)
        print()
    long_rows = [r for r in rows if r["path"].startswith("long_T")]
    if long_rows:
        print("Time per token against T (one head of a model's buffers, 1 thread, every length in "
              "every iteration;\n  targets: max / min over T = 8192 ... 65536 <= 1.25, "
              "T = 65536 within 1.3 x of T = 1024):")
        for r in sorted(long_rows, key=lambda r: (r["d"], r["path"])):
            per = sorted(((int(k.split("@")[1]), v) for k, v in r["long"].items()))
            ok = r["flat"] <= 1.25 and r["long_over_short"] <= 1.3
            layout = "head-major" if r["path"].endswith("head_first") else "token-major"
            path = r["path"][len("long_T_"):].replace("_head_first", "")
            print(f"  {path}, {layout}, d = {r['d']}: "
                  + ", ".join(f"{T}: {v:.0f}" for T, v in per)
                  + f" ns; max/min {r['flat']:.2f}, 65536/1024 {r['long_over_short']:.2f} "
                  + ("met" if ok else "NOT met"))
        print()


def plot(rows, dims, out, ctx):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(dims), figsize=(6 * len(dims), 4.5), squeeze=False)
    styles = {"chunked": "o-", "recurrent": "s-", "decode": "^-", "decode_interleaved": "v--",
              "quadratic": "x:", "softmax": "d:"}
    for ax, d in zip(axes[0], dims):
        for path in PATHS:
            sel = sorted(pick(rows, path=path, d=d, threads=1), key=lambda r: r["T"])
            if sel:
                ax.plot([r["T"] for r in sel], [r["ms"] for r in sel], styles[path], label=path)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("time per call, ms (8 heads)")
        ax.set_title(f"causal attention, d = {d}, float, 1 thread")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"linattn bench_paths ({ctx.get('simd_isa', '?')}, {cpu_model()})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"\nplot: {out}")


if __name__ == "__main__":
    main()
