"""Which model-parallel mesh axes the code being traced runs under.

`gtp_jax.ShardedModule` traces the wrapped module inside ``jax.shard_map`` and, while it does,
publishes the tensor-parallel and expert-parallel axes of its mesh here. Model code reads them
with `current_axes` to decide whether to run Megatron tensor/sequence parallelism (``tp``) or
expert parallelism (``ep``); outside a sharded call (the unsharded reference model) both are
None and the same code runs the plain single-device math.

``cp`` (context parallelism) is published only while the module's *inputs* are split over
the sequence, i.e. when the module opted in with ``gtp_input_layout`` (see
`gtp_jax.sharding.module.InputLayout`): model code that sees ``cp`` holds this rank's piece
of every sequence and must attend across the ring (`gtp_jax.parallel.context`).

The value is read at trace time only: gradient rules get the axis names they need as static
arguments, so nothing depends on the context being active when the backward pass is traced.
Code that calls ``jax.shard_map`` itself can publish axes with `use_axes`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

from jax.sharding import Mesh

#: Mesh axis of Megatron tensor + sequence parallelism.
TP_AXIS = "tp"
#: Mesh axis of expert parallelism.
EP_AXIS = "ep"
#: Mesh axis of context parallelism (the sequence split).
CP_AXIS = "cp"
#: Mesh axis GTP shards weights over (`GTPConfig.axis`'s default).
GTP_AXIS = "gtp"


@dataclasses.dataclass(frozen=True)
class ParallelAxes:
    """Model-parallel axes of the current ``shard_map`` (None: that parallelism is off).

    Attributes:
      tp: tensor/sequence-parallel axis name, or None.
      tp_size: number of ranks on `tp` (1 when off).
      ep: expert-parallel axis name, or None.
      ep_size: number of ranks on `ep` (1 when off).
      cp: context-parallel axis name, or None: when set, the module's batch inputs arrived
        split over it on dim 1 (the sequence), in the layout the module chose.
      cp_size: number of ranks on `cp` (1 when off).
      vocab: the axis a vocabulary-parallel embedding or output head splits its vocabulary
        over (`gtp_jax.parallel.vocab`), or None. Published only to a module whose
        ``gtp_output_layout`` asked for it (``OutputLayout.vocab``, see `vocab_axis`): the
        module then looks up and projects onto its own slice of the vocabulary for the
        tokens of every rank on this axis, moving activations instead of gathering the
        vocabulary-sized weights, and its logits leave split over this axis on the
        vocabulary dim.
      vocab_size: number of ranks on `vocab` (1 when off).
    """

    tp: str | None = None
    tp_size: int = 1
    ep: str | None = None
    ep_size: int = 1
    cp: str | None = None
    cp_size: int = 1
    vocab: str | None = None
    vocab_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "cp", "vocab"):
            axis, size = getattr(self, name), getattr(self, f"{name}_size")
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"ParallelAxes.{name}_size={size!r} must be a positive int.")
            if axis is None and size != 1:
                raise ValueError(
                    f"ParallelAxes: {name}_size={size} needs an axis name ({name}=None).")

    @classmethod
    def from_mesh(cls, mesh: Mesh) -> ParallelAxes:
        """``tp``/``ep``/``cp`` of `mesh` when their size is > 1 (size-1 axes count as off)."""
        tp = mesh.shape.get(TP_AXIS, 1)
        ep = mesh.shape.get(EP_AXIS, 1)
        cp = mesh.shape.get(CP_AXIS, 1)
        return cls(tp=TP_AXIS if tp > 1 else None, tp_size=int(tp),
                   ep=EP_AXIS if ep > 1 else None, ep_size=int(ep),
                   cp=CP_AXIS if cp > 1 else None, cp_size=int(cp))


def vocab_axis(mesh: Mesh) -> str | None:
    """The axis a vocabulary-parallel embedding or head can split its vocabulary over on
    `mesh` (`ParallelAxes.vocab`), or None: the GTP axis, when it has more than one rank,
    is the innermost axis the batch is split over (its ranks' batch rows are consecutive,
    so gathering them keeps the global row order), and neither ``tp`` nor ``cp`` splits
    the mesh."""
    names = tuple(mesh.axis_names)
    if GTP_AXIS not in names or mesh.shape[GTP_AXIS] == 1:
        return None
    if mesh.shape.get(TP_AXIS, 1) > 1 or mesh.shape.get(CP_AXIS, 1) > 1:
        return None
    data = [a for a in names if a not in (TP_AXIS, CP_AXIS)]
    return GTP_AXIS if data[-1] == GTP_AXIS else None


_OFF = ParallelAxes()
_CURRENT: contextvars.ContextVar[ParallelAxes | None] = contextvars.ContextVar(
    "gtp_jax_parallel_axes", default=None)


def current_axes() -> ParallelAxes:
    """The `ParallelAxes` published by the enclosing sharded call (all off outside one)."""
    axes = _CURRENT.get()
    return _OFF if axes is None else axes


@contextlib.contextmanager
def use_axes(axes: ParallelAxes) -> Iterator[ParallelAxes]:
    """Publishes `axes` to model code traced inside the ``with`` block.

    Example (inside your own ``jax.shard_map`` body)::

        with use_axes(ParallelAxes.from_mesh(mesh)):
            logits = model(tokens)
    """
    if not isinstance(axes, ParallelAxes):
        raise TypeError(f"use_axes: expected a ParallelAxes, got {type(axes).__name__}.")
    token = _CURRENT.set(axes)
    try:
        yield axes
    finally:
        _CURRENT.reset(token)
