"""The default peak learning rate and warm-up of each model preset.

A run that sets no ``TrainConfig.lr`` / ``warmup`` (``--lr`` / ``--warmup``) trains its
preset at the rate below, warming up over a tenth of its schedule's steps, at most the
preset's longest warm-up (`default_warmup`). Both are fixed when the run starts and recorded
in its checkpoints, so a resumed or extended run keeps them whatever these defaults become.
A model that is not a preset (``TrainConfig.init_from_hf``) takes `GENERIC`.

One rate for every size does not train: at ``3e-3`` (the tiny preset's rate), llama3-8b's
loss rose from 6.48 to 12.62 in 12 steps on two H200s (uniform over the byte vocabulary is
5.55). AdamW moves every weight by about the rate each step, so a wider matrix's output
moves more per step; published recipes lower the peak rate as the width grows. Each preset
takes the peak rate of a published model of its width (and, where there is one, its depth):

=============  =======  ======  =========  ===========  ==========================================
preset         d_model  layers  peak LR    max warm-up  published model of that shape and its LR
=============  =======  ======  =========  ===========  ==========================================
tiny           128      4       3e-3       10           (the library's test model; unchanged)
small          512      6       1e-3       10           Pythia-70M (512 wide, 6 layers): 1e-3
100m           768      12      6e-4       10           GPT-3 Small, Pythia-160M (768, 12): 6e-4
1b             2048     16      3e-4       50           Pythia-1B (2048, 16): 3e-4
llama3.2-1b    2048     16      3e-4       50           Pythia-1B (2048, 16): 3e-4
llama3.2-3b    3072     28      3e-4       100          Llama 3 8B, 4096 wide: 3e-4 (no wider)
llama3-8b      4096     32      3e-4       100          Llama 3 8B (and Llama 2 7B): 3e-4
llama3-70b     8192     80      1.5e-4     200          Llama 3 70B (and Llama 2 70B): 1.5e-4
=============  =======  ======  =========  ===========  ==========================================

Meta did not publish a pretraining rate of Llama 3.2 1B / 3B (pruned from Llama 3.1 8B and
distilled); their widths' published rates are used. The warm-up: the published recipes
warm up over thousands of steps of millions of tokens (Llama 2: 2000 steps; Llama 3 405B:
8000), runs here are mostly short, so the warm-up stays a tenth of the run
(a short run is not all warm-up), and only long runs reach the cap, which grows with the
width: 10 steps for the small presets (as before), 50 for the 2048-wide ones, 100 for 3B
and 8B, 200 for 70B (a 50-step llama3-8b run warms up over 5 steps, a 1000-step one over
100).
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
    """

    lr: float
    max_warmup: int
    origin: str


#: A model that is not a preset (a Hugging Face checkpoint's shape): the rate every preset
#: trained at before presets had their own, and a warm-up of at most 10 steps.
GENERIC = LrDefaults(3e-3, optim.MAX_DEFAULT_WARMUP, "the default for a model not from a preset")

#: Preset name -> its defaults (see the module docstring's table).
PRESET_LR: dict[str, LrDefaults] = {
    name: LrDefaults(lr, max_warmup, f"the {name} preset's default")
    for name, lr, max_warmup in (
        ("tiny", 3e-3, 10),
        ("small", 1e-3, 10),
        ("100m", 6e-4, 10),
        ("1b", 3e-4, 50),
        ("llama3.2-1b", 3e-4, 50),
        ("llama3.2-3b", 3e-4, 100),
        ("llama3-8b", 3e-4, 100),
        ("llama3-70b", 1.5e-4, 200),
    )
}


def lr_defaults(preset: str | None) -> LrDefaults:
    """The defaults of `preset` (`PRESET_LR`); `GENERIC` for None (a model that is not a
    preset) or a preset without an entry."""
    return PRESET_LR.get(preset, GENERIC) if preset is not None else GENERIC


def default_warmup(schedule_steps: int, defaults: LrDefaults = GENERIC) -> int:
    """The warm-up when none is given: a tenth of the schedule's steps (rounded down), at
    most ``defaults.max_warmup`` (`optim.default_warmup`)."""
    return optim.default_warmup(schedule_steps, longest=defaults.max_warmup)
