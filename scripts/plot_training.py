#!/usr/bin/python3
"""Plot the loss and recall-accuracy curves of the training examples.

Usage: plot_training.py [train_recall.csv | train_recall_rules.csv] [out.png]

examples/train_recall.cpp writes step, elu_loss, elu_accuracy, rf_loss, rf_accuracy;
examples/train_recall_rules.cpp writes step and <rule>_loss, <rule>_accuracy for additive,
gated and delta (held-out set, every 50 Adam steps). Every <name>_loss / <name>_accuracy pair
in the CSV becomes one curve. The plot goes to docs/img/<CSV name>.png unless out.png is given.
Run with Debian's /usr/bin/python3 (python3-matplotlib).
"""

import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {
    "elu": "ELU + 1",
    "rf": "positive random features (m = 16)",
    "additive": "Additive (ELU + 1)",
    "gated": "Gated (ELU + 1, learned gate per token)",
    "delta": "Delta (L2-normalized, learned beta per token)",
}


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = sys.argv[1] if len(sys.argv) > 1 else "train_recall.csv"
    stem = os.path.splitext(os.path.basename(source))[0]
    target = sys.argv[2] if len(sys.argv) > 2 else os.path.join(root, "docs", "img", stem + ".png")
    with open(source) as f:
        rows = list(csv.DictReader(f))
    step = [int(r["step"]) for r in rows]
    names = [c[:-len("_loss")] for c in rows[0] if c.endswith("_loss")]
    rules = "additive" in names

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(11 if rules else 10, 4))
    for name in names:
        label = LABELS.get(name, name)
        loss_ax.plot(step, [float(r[name + "_loss"]) for r in rows], label=label)
        acc_ax.plot(step, [float(r[name + "_accuracy"]) for r in rows], label=label)
    loss_ax.axhline(1.0, color="gray", linestyle=":", label="predict 0")
    loss_ax.set_xlabel("Adam step (batch of 32 sequences)")
    loss_ax.set_ylabel("held-out loss, mean |y - v|^2")
    loss_ax.legend()
    acc_ax.axhline(1 / 8, color="gray", linestyle=":", label="chance (1/8)")
    acc_ax.set_xlabel("Adam step (batch of 32 sequences)")
    acc_ax.set_ylabel("held-out recall accuracy")
    acc_ax.set_ylim(0, 1)
    acc_ax.legend()
    fig.suptitle("Learning one causal layer per write rule on associative recall (8 pairs, r = 16)"
                 if rules else
                 "Learning Wq, Wk, Wv of one causal linear-attention layer "
                 "(associative recall, 8 pairs, r = 16)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    fig.savefig(target, dpi=110)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
