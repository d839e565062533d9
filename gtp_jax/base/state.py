"""Variable types for state a module writes in ``__call__``, each naming how a sharded call
(`gtp_jax.shard`) combines the data shards' values into one.

Under `gtp_jax.shard` every data shard runs the module on its own slice of the batch, so
state written in ``__call__`` has one value per shard. The type of the variable says what
it holds, and so how the values combine (the same rules as the ``gtp_reduce`` metadata,
`gtp_jax.base.metadata.REDUCE`)::

    self.avg = gtp_jax.BatchMean(jnp.zeros((64,)))       # batch means, EMAs of them
    self.seen = gtp_jax.BatchSum(jnp.zeros(()))          # counts, sums, sums of squares
    self.calls = gtp_jax.SameOnEveryShard(jnp.zeros((), jnp.int32))  # step counters
    self.last = gtp_jax.PerExample(jnp.zeros((16, 64)))  # per-example caches

State of any other type written in ``__call__`` needs the metadata (``gtp_reduce='sum'``,
...) or the call is refused; no rule is guessed from the dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

from flax import nnx

#: Rule names (values of the ``gtp_reduce`` metadata) and what each does.
RULES: dict[str, str] = {
    "mean": "mean over the data shards (batch means, EMAs of them)",
    "sum": "the old value plus every shard's change (counts, sums, sums of squares)",
    "same": "identical on every shard, kept as is (step counters)",
    "concat": "per-example values (leading dim = the batch), concatenated over the shards",
}


class BatchMean(nnx.Variable):
    """State holding a mean over the batch (or an EMA of batch means): combined over the
    data shards by their mean, which equals the full batch's mean since every shard holds
    the same number of examples. Floating dtypes only."""

    gtp_rule = "mean"


class BatchSum(nnx.Variable):
    """State accumulating a sum over the examples (a count of examples seen, a sum, a sum of
    squares): combined as the old value plus the sum of every shard's change."""

    gtp_rule = "sum"


class SameOnEveryShard(nnx.Variable):
    """State every shard writes identically (a count of calls, a value computed from
    replicated inputs only): kept as is. Declaring it so is the caller's promise."""

    gtp_rule = "same"


class PerExample(nnx.Variable):
    """State holding one row per example (a cache of the last batch's activations): each
    shard writes its examples (leading dim = its part of the batch) and the rows are
    concatenated over the data shards, in batch order."""

    gtp_rule = "concat"


#: The variable types above, in the order errors list them.
STATE_TYPES: tuple[type[nnx.Variable], ...] = (BatchMean, BatchSum, SameOnEveryShard, PerExample)


def type_rule(var: nnx.Variable) -> str | None:
    """The rule implied by `var`'s type (None: the type implies none)."""
    for kind in STATE_TYPES:
        if isinstance(var, kind):
            return kind.gtp_rule
    if isinstance(var, nnx.RngCount):
        return "same"  # every shard draws the same number of times
    return None


__all__: Sequence[str] = ("RULES", "STATE_TYPES", "BatchMean", "BatchSum", "PerExample",
                          "SameOnEveryShard", "type_rule")
