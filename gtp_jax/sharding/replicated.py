"""`replicated`: an argument of a sharded call that every data shard receives whole.

A `gtp_jax.ShardedModule` splits each array argument on dim 0 over the data axes; an array
that is not per-example (a lookup table, a mask shared by every example) is passed as
``gtp_jax.replicated(x)``. The sharded call unwraps it. The same call on the unsharded module
(``gtp_jax.unshard``, the plain module a test compares against) must run unchanged, so the
wrapper is also an array-like: it converts to ``x`` wherever JAX or NumPy take an array
(``__jax_array__``, ``__array__``), and its operators, indexing and attributes (``shape``,
``dtype``, ``astype``, ...) are those of ``x``.
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import numpy as np

from gtp_jax.base.errors import UsageTypeError


@jax.tree_util.register_pytree_node_class
class Replicated:
    """An argument of a sharded module that every data shard receives whole (see
    `replicated`); elsewhere it acts as its array, ``value``."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def tree_flatten(self):
        return (self.value,), None

    @classmethod
    def tree_unflatten(cls, _: None, children: tuple[Any, ...]) -> Replicated:
        return cls(children[0])

    def __repr__(self) -> str:
        return f"replicated({self.value!r})"

    # -- the array it holds, for code that does not know the wrapper (the unsharded module)
    def __jax_array__(self) -> jax.Array:
        return jax.numpy.asarray(self.value)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        out = np.asarray(self.value, dtype=dtype)
        return out.copy() if copy else out

    def __getattr__(self, name: str) -> Any:
        # Not "value" (unset while copy / pickle build the object) nor protocol names such as
        # __deepcopy__: a copy of the wrapper must stay a wrapper.
        if name == "value" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.value, name)

    def __getitem__(self, index: Any) -> Any:
        return self.value[index]

    def __len__(self) -> int:
        return len(self.value)

    def __iter__(self):
        return iter(self.value)

    def __bool__(self) -> bool:
        return bool(self.value)

    def __int__(self) -> int:
        return int(self.value)

    def __float__(self) -> float:
        return float(self.value)

    def __index__(self) -> int:
        return operator.index(self.value)


def _binary(op: Any) -> tuple[Any, Any]:
    """The forward and reflected methods of binary `op`, applied to the held array (through
    `operator`, so that the other operand's own reflected method is tried as usual)."""
    def forward(self: Replicated, other: Any) -> Any:
        return op(self.value, other.value if isinstance(other, Replicated) else other)

    def reflected(self: Replicated, other: Any) -> Any:
        return op(other, self.value)

    return forward, reflected


for _name in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and",
              "or", "xor", "lshift", "rshift"):
    _op = getattr(operator, f"{_name}_" if _name in ("and", "or") else _name)
    _forward, _reflected = _binary(_op)
    setattr(Replicated, f"__{_name}__", _forward)
    setattr(Replicated, f"__r{_name}__", _reflected)
for _name in ("lt", "le", "eq", "ne", "gt", "ge"):
    setattr(Replicated, f"__{_name}__", _binary(getattr(operator, _name))[0])
for _name in ("neg", "pos", "abs", "invert"):
    setattr(Replicated, f"__{_name}__",
            (lambda op: lambda self: op(self.value))(getattr(operator, _name)))
Replicated.__hash__ = None  # type: ignore[assignment]  # equality is elementwise, as arrays'


def replicated(x: Any) -> Replicated:
    """Marks an array argument of a `ShardedModule` call as not batch-major.

    A sharded module splits every array argument on dim 0 over the data axes. Wrap arrays
    that are not per-example (a lookup table, a mask shared by all examples, a positional
    table) as ``model(tokens, gtp_jax.replicated(table))``: the module receives the plain
    array, whole and identical on every shard. The unsharded module can take the same call:
    there the wrapper acts as the array (``jnp`` functions, NumPy, operators, indexing and
    the array's attributes).

    >>> import jax.numpy as jnp, gtp_jax
    >>> table = gtp_jax.replicated(jnp.arange(4.0))
    >>> (jnp.ones(4) + table).tolist(), table[1].item(), table.shape
    ([1.0, 2.0, 3.0, 4.0], 1.0, (4,))

    Args:
      x: a ``jax.Array`` or ``np.ndarray`` of any shape and dtype.

    Returns:
      A wrapper (a pytree, so it may also pass through ``jax.jit``) that `ShardedModule`
      unwraps.
    """
    if not isinstance(x, (jax.Array, np.ndarray)) and not hasattr(x, "shape"):
        raise UsageTypeError(f"gtp_jax.replicated expects an array, got {type(x).__name__}.")
    return Replicated(x)


def is_replicated(x: Any) -> bool:
    return isinstance(x, Replicated)


def unwrap(x: Any) -> Any:
    return x.value if isinstance(x, Replicated) else x
