"""Plots the loss curves of `python -m gtp_jax train --metrics-json` files into one PNG.

Usage: python benchmarks/plot_loss.py OUT.png LABEL=metrics.json [LABEL=metrics.json ...]
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def main(out: str, runs: list[str]) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        label, path = run.split("=", 1)
        steps = json.load(open(path))["steps"]
        x = np.array([s["step"] for s in steps])
        y = np.array([s["loss"] for s in steps])
        smooth = np.convolve(y, np.ones(20) / 20, mode="valid")
        line, = ax.plot(x[19:], smooth, label=f"{label} (final {y[-10:].mean():.4f})")
        held = sorted((int(k), v) for k, v in
                      (json.load(open(path))["summary"].get("val_losses") or {}).items())
        if held:  # the held-out loss (--eval-every), same colour, markers
            ax.plot([k for k, _ in held], [v for _, v in held], "o--", color=line.get_color(),
                    label=f"{label} held-out (final {held[-1][1]:.4f})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (training: mean of 20 steps)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
