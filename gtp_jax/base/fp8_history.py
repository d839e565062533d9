"""`Fp8History`: the amax history of one FP8 layer under the "delayed" recipe.

``GTPConfig(fp8_compute="delayed")`` gives every FP8 layer one of these (created by
`gtp_jax.shard`; the user's module declares nothing): float32 ``[history_len, 4]``, the
absolute maxima of the layer's activation ``x``, weight ``w`` and output gradient ``dy``
over the last ``history_len`` steps, newest first, and how often the layer's matmul ran in
each of those steps (columns `HISTORY_COLUMNS`; a stacked layer's history has a leading
layer dim). It is replicated on every device and never GTP-sharded. The backward pass
returns the next history as this variable's "gradient" (each use of the layer contributes
1 to the use column, so the summed cotangent counts the uses); the training step
(`gtp_jax.train.TrainStep`, or `gtp_jax.apply_fp8_history` in a loop of one's own) writes
it into the variable, refusing a layer used more than once per step, and never hands it to
the optimizer. It is not an ``nnx.Param``, so ``nnx.Optimizer(..., wrt=nnx.Param)`` keeps no
moments for it, and checkpoints save it as model state.
"""

from __future__ import annotations

from flax import nnx

#: What each column of a history holds: three amaxes and the uses of the layer in the step.
HISTORY_COLUMNS = ("x", "w", "dy", "uses")

#: The column of `HISTORY_COLUMNS` that counts the layer's uses per step.
USES_COLUMN = HISTORY_COLUMNS.index("uses")


class Fp8History(nnx.Variable):
    """float32 ``[history_len, 4]`` (``[layers, history_len, 4]`` when stacked): amax of
    ``x``, ``w``, ``dy`` and the layer's uses per step, newest first (see the module
    docstring)."""
