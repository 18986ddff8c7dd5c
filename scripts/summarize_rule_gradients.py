#!/usr/bin/python3
"""Summarize bench_rule_gradients' Google Benchmark JSON: each write rule's backward next to its
own forward and to Additive's backward (measured in the same iterations).

Usage: summarize_rule_gradients.py RESULTS.json

Prints a table (rule, d, T: backward ms, backward / forward, backward / Additive's backward,
scratch bytes per token, and for Delta and GatedDelta the backward without a workspace over the
forward; medians over repetitions), the saved design's table (rule_saved_bwd
rows: the backward from saved states over the plain forward, the saving forward over the plain
one, saved bytes per token) and one line for the main command:
  rules backward: bwd/fwd <rule> <worst over d, T> [saved <worst>] ... (target <= 3)
Standard library only (json).
"""

import json
import statistics
import sys
from collections import defaultdict

TARGET = 3.0
RULES = {0: "additive", 1: "decay", 2: "gated", 3: "gated_channel", 4: "delta",
         5: "gated_delta", 6: "gated_delta_channel"}


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        data = json.load(f)
    rows = defaultdict(list)
    saved_rows = defaultdict(list)
    for b in data["benchmarks"]:
        if b.get("run_type") == "aggregate":
            continue
        if "rule" not in b:
            continue
        key = (int(b["rule"]), int(b["d"]), int(b["T"]))
        (saved_rows if b.get("design", 0) == 1 else rows)[key].append(b)
    if not rows:
        print("summarize_rule_gradients: no rule_bwd rows", file=sys.stderr)
        return 1
    med = lambda rs, key: statistics.median(r[key] for r in rs)  # noqa: E731
    print("recomputing design (a BackwardWorkspace kept across calls; 'no ws': without one):")
    print(f"{'rule':>14} {'d':>4} {'T':>6} {'bwd ms':>9} {'bwd/fwd':>8} {'bwd/add.bwd':>12} "
          f"{'scratch B/tok':>14} {'no ws/fwd':>10}")
    worst = defaultdict(float)
    for key in sorted(rows):
        rule, d, T = key
        rs = rows[key]
        ratio = med(rs, "bwd_over_fwd")
        worst[rule] = max(worst[rule], ratio)
        print(f"{RULES.get(rule, rule):>14} {d:>4} {T:>6} {med(rs, 'bwd_ms'):>9.2f} "
              f"{ratio:>8.2f} {med(rs, 'bwd_over_additive_bwd'):>12.2f} "
              f"{med(rs, 'scratch_B/token'):>14.0f} "
              + (f"{med(rs, 'fresh_over_fwd'):>10.2f}" if "fresh_over_fwd" in rs[0]
                 else f"{'-':>10}"))
    worst_saved = defaultdict(float)
    if saved_rows:
        print(f"saved design (bwd from saved states / plain fwd):")
        print(f"{'rule':>14} {'d':>4} {'T':>6} {'bwd ms':>9} {'bwd/fwd':>8} {'saving/fwd':>11} "
              f"{'saved B/tok':>12}")
        for key in sorted(saved_rows):
            rule, d, T = key
            rs = saved_rows[key]
            ratio = med(rs, "bwd_over_fwd")
            worst_saved[rule] = max(worst_saved[rule], ratio)
            print(f"{RULES.get(rule, rule):>14} {d:>4} {T:>6} {med(rs, 'bwd_ms'):>9.2f} "
                  f"{ratio:>8.2f} {med(rs, 'saving_over_fwd'):>11.2f} "
                  f"{med(rs, 'saved_B/token'):>12.0f}")
    mark = lambda x: '' if x <= TARGET else ' (!)'  # noqa: E731
    parts = [f"{RULES.get(rule, rule)} {worst[rule]:.2f}{mark(worst[rule])}"
             + (f" saved {worst_saved[rule]:.2f}{mark(worst_saved[rule])}"
                if rule in worst_saved else "")
             for rule in sorted(worst)]
    print(f"rules backward: worst bwd/fwd per rule over d, T (recomputing [saved design]): "
          f"{', '.join(parts)} (target <= {TARGET:g}; (!) missed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
