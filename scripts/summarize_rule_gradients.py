#!/usr/bin/python3
"""Summarize bench_rule_gradients' Google Benchmark JSON: each write rule's backward next to its
own forward and to Additive's backward (measured in the same iterations).

Usage: summarize_rule_gradients.py RESULTS.json

Prints a table (rule, d, T: backward ms, backward / forward, backward / Additive's backward,
scratch bytes per token; medians over repetitions) and one line for the main command:
  rules backward: bwd/fwd <rule> <worst over d, T> ... (target <= 3)
Standard library only (json).
"""

import json
import statistics
import sys
from collections import defaultdict

TARGET = 3.0
RULES = {0: "additive", 1: "decay", 2: "gated", 3: "gated_channel", 4: "delta",
         5: "gated_delta"}


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        data = json.load(f)
    rows = defaultdict(list)
    for b in data["benchmarks"]:
        if b.get("run_type") == "aggregate" or "rule" not in b:
            continue
        rows[(int(b["rule"]), int(b["d"]), int(b["T"]))].append(b)
    if not rows:
        print("summarize_rule_gradients: no rule_bwd rows", file=sys.stderr)
        return 1
    med = lambda rs, key: statistics.median(r[key] for r in rs)  # noqa: E731
    print(f"{'rule':>14} {'d':>4} {'T':>6} {'bwd ms':>9} {'bwd/fwd':>8} {'bwd/add.bwd':>12} "
          f"{'scratch B/tok':>14}")
    worst = defaultdict(float)
    for key in sorted(rows):
        rule, d, T = key
        rs = rows[key]
        ratio = med(rs, "bwd_over_fwd")
        worst[rule] = max(worst[rule], ratio)
        print(f"{RULES.get(rule, rule):>14} {d:>4} {T:>6} {med(rs, 'bwd_ms'):>9.2f} "
              f"{ratio:>8.2f} {med(rs, 'bwd_over_additive_bwd'):>12.2f} "
              f"{med(rs, 'scratch_B/token'):>14.0f}")
    parts = [f"{RULES.get(rule, rule)} {worst[rule]:.2f}{'' if worst[rule] <= TARGET else ' (!)'}"
             for rule in sorted(worst)]
    print(f"rules backward: worst bwd/fwd per rule over d, T: {', '.join(parts)} "
          f"(target <= {TARGET:g}; (!) missed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
