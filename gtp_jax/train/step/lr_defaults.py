"""The default peak learning rate and warm-up of each model preset.

A run that sets no ``TrainConfig.lr`` / ``warmup`` (``--lr`` / ``--warmup``) trains its
preset at the rate below, warming up over its share of the schedule's steps, at most the
preset's longest warm-up (`default_warmup`). Both are fixed when the run starts and recorded
in its checkpoints, so a resumed or extended run keeps them whatever these defaults become.
A model that is not a preset (``TrainConfig.init_from_hf``) takes `GENERIC`.

One rate for every size does not train: at ``3e-3`` (the tiny preset's rate), llama3-8b's
loss rose from 6.48 to 12.62 in 12 steps on two H200s (uniform over the byte vocabulary is
5.55). Published rates do not either: they are for batches of millions of tokens, and a run on
a few GPUs trains thousands to tens of thousands a step. AdamW's first updates move every
weight by about the rate whatever its gradient; across a wide, deep stack that moves the
output by a large share of itself, and the loss rises during the warm-up before it comes
down. Each preset's rate is the highest of those measured whose loss never rose more than
1.0 above its lowest so far in 50 steps at 4,096 tokens a step (2 x 2048; one H100,
2026-12-07, ``docs/results/2026-12-07_1xH100_lr/``), lowered where the preset is deeper
than what fit on one GPU:

=============  =======  ======  =======  =======  ===========  ================================
preset         d_model  layers  peak LR  warm-up  max warm-up  measured (layers: LR -> rise)
=============  =======  ======  =======  =======  ===========  ================================
tiny           128      2       3e-3     1/10     10           (the test model; unchanged)
small          512      6       1e-3     1/10     10           6: 1e-3 -> 0.16
100m           768      12      3e-4     1/10     10           12: 6e-4 -> 1.35, 3e-4 -> 0.71
1b             2048     16      3e-5     1/4      50           16: 3e-4 -> 3.88, 1e-4 -> 1.89,
                                                               6e-5 -> 1.17, 3e-5 -> 0.22
llama3.2-1b    2048     16      3e-5     1/4      50           16: 3e-4 -> 5.07 (as 1b)
llama3.2-3b    3072     28      2e-5     1/2      100          8: 1.5e-4 -> 3.24, 6e-5 -> 0.87,
                                                               3e-5 -> 0.27; 28 deep: lower
llama3-8b      4096     32      1e-5     1/2      200          8: 7.5e-5 -> 1.28, 3e-5 -> 0.42;
                                                               16: 1.5e-4 -> 7.55, 3e-5 -> 1.42,
                                                               2e-5 -> 0.71, 1e-5 -> 0.32
llama3-70b     8192     80      5e-6     1/2      400          2: 7.5e-5 -> 1.08, 3e-5 -> 0.35,
                                                               1.5e-5 -> 0.23; 80 deep: lower
=============  =======  ======  =======  =======  ===========  ================================

The rates that stayed stable ended the 50 steps within 0.08 of the lowest loss measured at
their width and depth; those whose loss rose, up to 0.26 above it. The stable rate halved
from 8 to 16 llama3-8b layers, so a preset deeper than what fit on one GPU takes less than
its measured stable rate: llama3-8b (32 layers) half its 16-layer rate; llama3.2-3b (28) and
llama3-70b (80) by the same judgement, not measured. A run with a batch of millions of tokens
can take the published rates (``--lr``). The widest presets warm up over half the run (at
most the cap), the 2048-wide ones over a quarter, the small ones over a tenth.
"""

from __future__ import annotations

import dataclasses

from gtp_jax.train.step import optim


@dataclasses.dataclass(frozen=True)
class LrDefaults:
    """A model's default schedule.

    Attributes:
      lr: the peak learning rate.
      max_warmup: the longest default warm-up in steps (`default_warmup`).
      origin: what the values are, in words (the run's header names it).
      warmup_fraction: the default warm-up's share of the run's steps.
    """

    lr: float
    max_warmup: int
    origin: str
    warmup_fraction: float = optim.DEFAULT_WARMUP_FRACTION


#: A model that is not a preset (a Hugging Face checkpoint's shape): the rate every preset
#: trained at before presets had their own, and a warm-up of at most 10 steps.
GENERIC = LrDefaults(3e-3, optim.MAX_DEFAULT_WARMUP, "the default for a model not from a preset")

#: Preset name -> its defaults (see the module docstring's table).
PRESET_LR: dict[str, LrDefaults] = {
    name: LrDefaults(lr, max_warmup, f"the {name} preset's default", fraction)
    for name, lr, max_warmup, fraction in (
        ("tiny", 3e-3, 10, 0.1),
        ("small", 1e-3, 10, 0.1),
        ("100m", 3e-4, 10, 0.1),
        ("1b", 3e-5, 50, 0.25),
        ("llama3.2-1b", 3e-5, 50, 0.25),
        ("llama3.2-3b", 2e-5, 100, 0.5),
        ("llama3-8b", 1e-5, 200, 0.5),
        ("llama3-70b", 5e-6, 400, 0.5),
    )
}


def lr_defaults(preset: str | None) -> LrDefaults:
    """The defaults of `preset` (`PRESET_LR`); `GENERIC` for None (a model that is not a
    preset) or a preset without an entry."""
    return PRESET_LR.get(preset, GENERIC) if preset is not None else GENERIC


def describe_warmup(defaults: LrDefaults) -> str:
    """``"a tenth of the steps, at most 10"``: how `default_warmup` picks the warm-up."""
    share = {0.1: "a tenth", 0.25: "a quarter", 0.5: "half"}.get(
        defaults.warmup_fraction, f"{defaults.warmup_fraction:g}")
    return f"{share} of the steps, at most {defaults.max_warmup}"


def default_warmup(schedule_steps: int, defaults: LrDefaults = GENERIC) -> int:
    """The warm-up when none is given: ``defaults.warmup_fraction`` of the schedule's steps
    (rounded down), at most ``defaults.max_warmup`` (`optim.default_warmup`)."""
    return optim.default_warmup(schedule_steps, longest=defaults.max_warmup,
                                fraction=defaults.warmup_fraction)
