"""The default peak learning rate and warm-up of each model preset.

A run that sets no ``TrainConfig.lr`` / ``warmup`` (``--lr`` / ``--warmup``) trains its
preset at the rate below, warming up over its share of the schedule's steps, at most the
preset's longest warm-up (`default_warmup`). Both are fixed when the run starts and recorded
in its checkpoints, so a resumed or extended run keeps them whatever these defaults become.
A model that is not a preset (``TrainConfig.init_from_hf``) takes `GENERIC`.

One rate for every size does not train: at ``3e-3`` (the tiny preset's rate), llama3-8b's
loss rose from 6.48 to 12.62 in 12 steps on two H200s (uniform over the byte vocabulary is
5.55). AdamW moves every weight by about the rate each step, so a wider matrix's output
moves more per step; published recipes lower the peak rate as the width grows. Each preset
takes the peak rate of a published model of its width (and, where there is one, its depth):

=============  =======  ======  =========  =========  ===========  ==============================
preset         d_model  layers  peak LR    warm-up    max warm-up  published model, its peak LR
=============  =======  ======  =========  =========  ===========  ==============================
tiny           128      2       3e-3       1/10       10           (the test model; unchanged)
small          512      6       1e-3       1/10       10           Pythia-70M: 1e-3
100m           768      12      6e-4       1/10       10           GPT-3 Small, Pythia-160M: 6e-4
1b             2048     16      3e-4       1/4        50           Pythia-1B: 3e-4
llama3.2-1b    2048     16      3e-4       1/4        50           Pythia-1B: 3e-4
llama3.2-3b    3072     28      1.5e-4     1/2        100          Llama 3 8B: 3e-4, halved
llama3-8b      4096     32      1.5e-4     1/2        200          Llama 3 8B: 3e-4, halved
llama3-70b     8192     80      7.5e-5     1/2        400          Llama 3 70B: 1.5e-4, halved
=============  =======  ======  =========  =========  ===========  ==============================

Meta did not publish a pretraining rate of Llama 3.2 1B / 3B (pruned from Llama 3.1 8B and
distilled); their widths' published rates are used. The published rates of the 4096- and
8192-wide models are for batches of about 4M tokens warmed up over thousands of steps
(Llama 2: 2000 steps; Llama 3 405B: 8000). A run on a few GPUs trains batches of tens of
thousands of tokens for tens to thousands of steps: AdamW's first updates move every weight
by about the rate whatever its gradient, and across a 4096-wide layer that moves its output
by a large share of itself. On 2x H200 (2026-11-28) llama3-8b at 3e-4 warmed up over 5 of 50
steps went from loss 6.48 to 24.2 by step 6 before coming down (uniform over the byte
vocabulary is 5.55). So the widest presets take half the published rate and warm up over
half the run (at most the cap); the 2048-wide ones over a quarter; the small ones over a
tenth (a short run is not all warm-up). A 1000-step llama3-8b run warms up over 200 steps.
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
        ("100m", 6e-4, 10, 0.1),
        ("1b", 3e-4, 50, 0.25),
        ("llama3.2-1b", 3e-4, 50, 0.25),
        ("llama3.2-3b", 1.5e-4, 100, 0.5),
        ("llama3-8b", 1.5e-4, 200, 0.5),
        ("llama3-70b", 7.5e-5, 400, 0.5),
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
