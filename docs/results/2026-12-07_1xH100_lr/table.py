"""The table of README.md, read from runs/*.txt: python docs/results/2026-12-07_1xH100_lr/table.py

For each run: its peak LR and warm-up (from the run's header), the first loss, the largest
rise of the loss above its lowest value so far (and the step it happened at), and the mean of
the last five steps' losses.
"""

import pathlib
import re

RUNS = pathlib.Path(__file__).parent / "runs"


def row(path: pathlib.Path) -> str:
    text = path.read_text().replace("\r", "\n")
    losses = [float(x) for x in re.findall(r"step +\d+/\d+ loss ([\d.]+)", text)]
    header = re.search(r"train: lr ([\d.e-]+).*?warm-up (\d+) steps", text)
    preset, layers = re.match(r"(.+)_(\d+)L_", path.name).groups()
    lowest, rise, at = losses[0], 0.0, 1
    for step, loss in enumerate(losses, 1):
        if loss - lowest > rise:
            rise, at = loss - lowest, step
        lowest = min(lowest, loss)
    return (f"| {preset} | {layers} | {float(header[1]):g} | {header[2]} | {losses[0]:.2f} | "
            f"{rise:.2f} (step {at}) | {sum(losses[-5:]) / 5:.3f} |")


def key(path: pathlib.Path) -> tuple:
    preset, layers, lr = re.match(r"(.+)_(\d+)L_lr([\d.e-]+?)(?:_|\.txt)", path.name).groups()
    return preset, int(layers), -float(lr), path.name


if __name__ == "__main__":
    print("| preset | layers | peak LR | warm-up | first loss | largest rise | last 5 |")
    print("|---|---|---|---|---|---|---|")
    for path in sorted(RUNS.glob("*.txt"), key=key):
        print(row(path))
