"""A layer-stacked GTP shard seen once per data rank, so that its gradient is summed in the
layer loop rather than where the sharded call's ``shard_map`` ends.

``shard_map`` (``check_vma=False``) sums an input's cotangent over every mesh axis its
in-spec does not name: for a stack of GTP shards, over the data axes, once over the whole
stacks after the backward pass. `data_view` names those axes: ``[n, *shard]`` becomes
``[n, 1, *shard]`` per device (global ``[prod(data sizes), *stack]``, the data axes on dim
0), and its backward keeps one rank's slice of the cotangent without communicating, which
is exact because the loop has summed each layer's gradient shard over the same axes
already (`GatherSpec.data_axes`). Both directions are local reshapes.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


def viewed_spec(spec: P, axes: tuple[str, ...]) -> P:
    """The in-spec of `data_view`'s output: `axes` on a new leading dim, then `spec`."""
    return P(axes, *spec)


def unmentioned_axes(mesh: Mesh, spec: P) -> tuple[str, ...]:
    """The axes of `mesh` of size > 1 that `spec` does not name (those ``shard_map`` sums
    a cotangent over), in mesh order."""
    named = {a for entry in spec if entry is not None
             for a in (entry if isinstance(entry, tuple) else (entry,))}
    return tuple(a for a in mesh.axis_names if a not in named and mesh.shape[a] > 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def data_view(xs: tuple[jax.Array, ...], mesh: Mesh, specs: tuple[P, ...],
              axes: tuple[tuple[str, ...], ...]) -> tuple[jax.Array, ...]:
    """Each of `xs` (global arrays laid out as `specs` on `mesh`) with a leading dim over
    its `axes`, in one local ``shard_map`` each way (traced once per call, not per leaf).

    Args:
      xs: e.g. stacked GTP shards ``[n, ...]``, replicated over their `axes`.
      mesh: the mesh of the sharded call.
      specs: the partition spec of each of `xs`.
      axes: for each of `xs`, the mesh axes its spec does not name (`unmentioned_axes`).

    Returns:
      For each ``x``: ``[prod(sizes of its axes), *x.shape]`` laid out as
      ``viewed_spec(spec, axes)``: every rank's slice is its own copy of ``x``. The gradient
      is one rank's slice of the cotangent, which the caller must have made equal on every
      rank.
    """
    return _local(lambda *s: tuple(v[None] for v in s), mesh, specs,
                  _viewed_specs(specs, axes))(*xs)


def _viewed_specs(specs, axes) -> tuple[P, ...]:
    return tuple(viewed_spec(s, a) for s, a in zip(specs, axes))


def _local(fn, mesh: Mesh, in_specs: tuple[P, ...], out_specs: tuple[P, ...]):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


def _fwd(xs, mesh, specs, axes):
    return data_view(xs, mesh, specs, axes), None


def _bwd(mesh, specs, axes, _, cts):
    return (_local(lambda *c: tuple(v[0] for v in c), mesh, _viewed_specs(specs, axes),
                   specs)(*cts),)


data_view.defvjp(_fwd, _bwd)
