#!/usr/bin/python3
"""Plot the loss and recall-accuracy curves written by examples/train_recall_rules.cpp.

Usage: plot_rules_training.py [train_recall_rules.csv] [docs/img/train_recall_rules.png]

Run with Debian's /usr/bin/python3 (python3-matplotlib). The CSV has the columns step and,
for each of additive, gated, delta, <rule>_loss and <rule>_accuracy (held-out set, every 50
Adam steps).
"""

import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RULES = (("additive", "Additive (ELU + 1)"),
         ("gated", "Gated (ELU + 1, learned gate per token)"),
         ("delta", "Delta (L2-normalized, learned beta per token)"))


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = sys.argv[1] if len(sys.argv) > 1 else "train_recall_rules.csv"
    target = sys.argv[2] if len(sys.argv) > 2 else os.path.join(root, "docs", "img",
                                                                 "train_recall_rules.png")
    with open(source) as f:
        rows = list(csv.DictReader(f))
    step = [int(r["step"]) for r in rows]

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in RULES:
        loss_ax.plot(step, [float(r[key + "_loss"]) for r in rows], label=label)
        acc_ax.plot(step, [float(r[key + "_accuracy"]) for r in rows], label=label)
    loss_ax.axhline(1.0, color="gray", linestyle=":", label="predict 0")
    loss_ax.set_xlabel("Adam step (batch of 32 sequences)")
    loss_ax.set_ylabel("held-out loss, mean |y - v|^2")
    loss_ax.legend()
    acc_ax.axhline(1 / 8, color="gray", linestyle=":", label="chance (1/8)")
    acc_ax.set_xlabel("Adam step (batch of 32 sequences)")
    acc_ax.set_ylabel("held-out recall accuracy")
    acc_ax.set_ylim(0, 1)
    acc_ax.legend()
    fig.suptitle("Learning one causal layer per write rule on associative recall "
                 "(8 pairs, r = 16)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fig.savefig(target, dpi=110)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
