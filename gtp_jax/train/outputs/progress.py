"""A dependency-free progress bar for training loops."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``[#####-----] step 10/20 loss 2.31 12.3k tok/s``, redrawn in place on a terminal.

    On a non-terminal stream (CI logs) it prints one line every `every` steps instead.
    """

    def __init__(self, total: int, *, width: int = 30, every: int = 5,
                 stream: TextIO | None = None, label: str = "step", unit: str = ""):
        self.total = total
        self.label = label
        self.unit = unit
        self.width = width
        self.every = max(1, every)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()

    def update(self, step: int, *, keep: bool = False, **metrics: float) -> None:
        """Shows progress after `step` (1-based) with `metrics` such as loss and tokens/s;
        `keep` leaves this line in place (a terminal) or prints it whatever `every` says."""
        if not keep and not self.tty and step % self.every and step != self.total:
            return
        filled = int(self.width * step / max(1, self.total))
        bar = "#" * filled + "-" * (self.width - filled)
        text = " ".join(_fmt(k, v) for k, v in metrics.items())
        line = f"[{bar}] {self.label} {step}/{self.total}{self.unit} {text}"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if step == self.total or keep else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _fmt(name: str, value: float) -> str:
    if name.endswith("tok_s"):
        return f"{value / 1e3:.1f}k tok/s"
    if name == "lr":
        return f"lr {value:.3g}"
    if name == "grad_norm":
        return f"grad_norm {value:.3f}"
    if name == "dropped":  # a mixture of experts' routing dropped at capacity
        return f"dropped {value:.1%}"
    if name == "MiB":
        return f"{value:.1f} MiB"
    return f"{name} {value:.4f}"
