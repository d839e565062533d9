"""`Fp8History`: the amax history of one FP8 layer under the "delayed" recipe.

``GTPConfig(fp8_compute="delayed")`` gives every FP8 layer one of these (created by
`gtp_jax.shard`; the user's module declares nothing): float32 ``[history_len, 3]``, the
absolute maxima of the layer's activation ``x``, weight ``w`` and output gradient ``dy``
(columns `HISTORY_COLUMNS`) over the last ``history_len`` steps, newest first (a stacked
layer's history has a leading layer dim). It is replicated on every device and never
GTP-sharded. The backward pass returns the next history as this variable's "gradient"; the
training step (`gtp_jax.train.TrainStep`) writes it into the variable and never hands it to
the optimizer. It is not an ``nnx.Param``, so ``nnx.Optimizer(..., wrt=nnx.Param)`` keeps no
moments for it, and checkpoints save it as model state.
"""

from __future__ import annotations

from flax import nnx

#: What each column of a history holds.
HISTORY_COLUMNS = ("x", "w", "dy")


class Fp8History(nnx.Variable):
    """float32 ``[history_len, 3]`` (``[layers, history_len, 3]`` when stacked): amax of
    ``x``, ``w``, ``dy`` per step, newest first (see the module docstring)."""
