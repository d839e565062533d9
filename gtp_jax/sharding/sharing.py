"""Weights shared between a sharded module and the rest of a model are refused, not untied.

`gtp_jax.shard` returns a copy of the module it is given: new variables in the sharded
layout. A variable or submodule that the module shares with the rest of a model (a tied
embedding read by the sharded head and by the unsharded input layer) would then be two
variables, trained apart, and the model's losses would drift from the unsharded model's
without an error. Two checks refuse it instead:

- `check_not_shared` (in `shard`): a model that holds the module (one that a caller of
  `shard` holds, `_caller_models`) also reaches a variable or submodule of it other than
  through it, or holds the module itself at two places. This finds the usual
  pattern ``model.head = gtp_jax.shard(model.head, mesh)`` of a model built beforehand.
- `check_untied` (`gtp_jax.train.TrainStep`, `gtp_jax.check_sharded`, and every call of a
  `ShardedModule`, through `check_callers`): a model holds, outside a `ShardedModule`, a
  variable or submodule that `shard` copied into that module (`record_sources`), or two
  sharded modules hold copies of one. This finds a model assembled after the sharding, from
  the sharded module and the originals of its parts (``self.trunk = shard(t); self.emb =
  t.embed``; ``self.inner = shard(Inner(self.proj))`` while the model also calls
  ``self.proj``), wherever it is trained: a call finds the models around it in its callers'
  frames (plain ``nnx.jit`` and ``nnx.Optimizer`` hold the model there, as a training loop
  does). At `shard` time such a model cannot be told from an unrelated module that shares
  the variables (``nnx.merge(*nnx.split(m))`` shares them with ``m``), so it is refused at
  the first call.

Random number state (``nnx.Rngs``, streams, keys, counts) is exempt: a sharded module folds
its keys per data shard, so its draws never equal the unsharded module's anyway.
"""

from __future__ import annotations

import sys
import weakref
from types import ModuleType
from typing import Any

from flax import nnx

from gtp_jax.base.errors import UsageError
from gtp_jax.sharding.contract import key_name
from gtp_jax.sharding.plan import path_str

_RNG = (nnx.Rngs, nnx.RngStream, nnx.RngState)

_FIX = ("shard the module that holds every use of it (e.g. the whole model: a weight used "
        "in several places stays one weight there)")


def _is_node(x: Any) -> bool:
    """A graph node (module, ``nnx.List``...) or a variable."""
    return isinstance(x, nnx.Variable) or nnx.graph.is_graph_node(x)


def _children(node: Any) -> list[tuple[Any, Any]]:
    """``(key, child)`` of a graph node or plain container (as ``nnx.iter_graph`` walks)."""
    if isinstance(node, nnx.Variable):
        return []
    if not nnx.graph.is_node(node):
        return []
    impl = nnx.graph.get_node_impl(node)
    return [] if impl is None else list(impl.node_dict(node).items())


def _a(name: str) -> str:
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def _walk(top: Any, stop: Any = None, stops: list[str] | None = None
          ) -> dict[int, tuple[str, Any]]:
    """``{id: (path, node)}`` of the graph nodes and variables reachable from `top` (first
    path found), not descending into `stop`; the path of every reference to `stop` is
    appended to `stops`."""
    out: dict[int, tuple[str, Any]] = {}
    stack: list[tuple[tuple, Any]] = [((), top)]
    while stack:
        keys, node = stack.pop()
        if node is stop and stops is not None:
            stops.append(path_str(key_name(k) for k in keys))
        if id(node) in out:
            continue
        if _is_node(node):
            out[id(node)] = (path_str(key_name(k) for k in keys), node)
        if node is stop:
            continue
        for key, child in reversed(_children(node)):
            if child is stop or id(child) not in out and (
                    _is_node(child) or nnx.graph.is_node(child)):
                stack.append(((*keys, key), child))
    return out


def check_not_shared(module: nnx.Module, where: str = "gtp_jax.shard") -> None:
    """Raises `UsageError` when a variable or submodule of `module` (other than `module`
    itself) is also reachable from a model that holds `module`, other than through `module`
    (see the module docstring).

    The models holding `module` are found among the callers' local variables
    (`_caller_models`), as ``model.head = gtp_jax.shard(model.head, mesh)`` has them, at
    the cost of a walk of each model's graph, whatever else the process holds. A model
    that holds `module` but that no caller can see is not checked here; `check_callers`
    refuses the tie at its first call. Nothing is changed.
    """
    inside: dict[int, tuple[str, Any]] | None = None
    name = type(module).__name__
    reached_before: set[int] = set()
    for top in _caller_models(sys._getframe(1)):  # noqa: SLF001 - the callers' models
        if top is module or id(top) in reached_before:
            continue  # inside a model checked already (or the module itself)
        stops: list[str] = []
        reached = _walk(top, stop=module, stops=stops)
        reached_before.update(reached)
        if not stops:  # does not hold the module
            continue
        inside = _walk(module) if inside is None else inside
        for node_id, (path, node) in reached.items():
            if node_id in inside and node is not module and not isinstance(node, _RNG):
                inner = inside[node_id][0]
                raise UsageError(
                    f"{where}: {inner!r} ({_a(type(node).__name__)}) of this {name} is also "
                    f"held at {path!r} of the {type(top).__name__} that holds it, a weight "
                    "shared with the rest of the model (e.g. a tied embedding); shard() "
                    "copies the module, which would untie the two uses and train them apart: "
                    f"{_FIX}.")
        if len(stops) > 1:
            raise UsageError(
                f"{where}: this {name} is held at {len(stops)} places of the "
                f"{type(top).__name__} that holds it ({', '.join(map(repr, stops))}), a module "
                "shared with the rest of the model; shard() returns one copy, and a place "
                f"left holding the original would train apart from it: {_FIX}.")


# --------------------------------------------------------------------------- after shard()

#: ``id(sharded module) -> (weakref to it, {id(source node): guard})``: what `shard` copied
#: into each sharded module. A guard is a weak reference to the source node, or (variables
#: cannot be weakly referenced) to its value when it was copied; an entry counts only
#: while its guard is alive and still the node's (or the node's value), so a recycled id
#: never matches.
_SOURCES: dict[int, tuple[weakref.ref, dict[int, weakref.ref]]] = {}
#: Ids of sharded modules (in `_SOURCES`) holding a copy of a node another one holds too.
_TWINS: set[int] = set()


def _guard(node: Any) -> weakref.ref | None:
    for target in (node, node.get_value() if isinstance(node, nnx.Variable) else None):
        if target is None:
            continue
        try:
            return weakref.ref(target)
        except TypeError:
            continue
    return None


def record_sources(sharded: nnx.Module, source: nnx.Module) -> None:
    """Remembers the variables and submodules of `source` that `sharded` holds copies of
    (for `check_untied`); keeps none of them alive."""
    for key in [k for k, (ref, _) in _SOURCES.items() if ref() is None]:
        del _SOURCES[key]
        _TWINS.discard(key)
    guards = {}
    for _, node in _walk(source).values():
        if _is_node(node) and not isinstance(node, _RNG):
            guard = _guard(node)
            if guard is not None:
                guards[id(node)] = guard
    pairs = {(node_id, id(guard)) for node_id, guard in guards.items()}
    for key, (ref, others) in _SOURCES.items():
        if ref() is not None and pairs & {(n, id(g)) for n, g in others.items()}:
            _TWINS.update((key, id(sharded)))  # copies of one node: `_check_copied_twice`
    _SOURCES[id(sharded)] = (weakref.ref(sharded), guards)


def _copied(sharded: Any, node: Any) -> bool:
    entry = _SOURCES.get(id(sharded))
    if entry is None or entry[0]() is not sharded:
        return False
    guard = entry[1].get(id(node))
    if guard is None:
        return False
    held = guard()
    return held is not None and (held is node or (
        isinstance(node, nnx.Variable) and held is node.get_value()))


class HoldsShards:
    """Base of `gtp_jax.ShardedModule`: lets this module recognise sharded modules in a
    graph without importing the module that defines them (which imports this one)."""


def check_untied(model: Any, where: str, nodes: Any = None) -> None:
    """Raises `UsageError` when `model` (any NNX graph: a module, or a tuple of them) holds,
    outside one of its `ShardedModule`s, a variable or submodule that `gtp_jax.shard`
    copied into that sharded module, or holds two sharded modules with copies of one
    variable or submodule (see the module docstring). `nodes`: ``_walk(model).values()``,
    if already computed."""
    nodes = _walk(model).values() if nodes is None else nodes
    sharded = [(path, node) for path, node in nodes if isinstance(node, HoldsShards)]
    if not sharded:
        return
    _check_copied_twice(sharded, where)
    for path, node in nodes:
        if isinstance(node, _RNG):
            continue
        for where_sm, sm in sharded:
            if not where_sm or path == where_sm or path.startswith(where_sm + "/"):
                continue  # inside the sharded module (every path is, for the root)
            if _copied(sm, node):
                at = f"the sharded module at {where_sm!r}" if where_sm else "the sharded module"
                raise UsageError(
                    f"{where}: the model holds {path!r} ({_a(type(node).__name__)}) outside "
                    f"{at}, which gtp_jax.shard copied from the module it sharded: a weight "
                    "shared with the rest of the model (e.g. a tied embedding) is now two "
                    f"weights, trained apart; {_FIX}.")



def _check_copied_twice(sharded: list[tuple[str, Any]], where: str) -> None:
    """Two sharded modules of one model made from modules that shared a part: each holds a
    copy of it (its guard, a weak reference, is one object for one referent)."""
    seen: dict[tuple[int, int], str] = {}
    for path, sm in sharded:
        entry = _SOURCES.get(id(sm))
        if entry is None or entry[0]() is not sm:
            continue
        mine = {(node_id, id(guard)) for node_id, guard in entry[1].items()}
        for guard_id in mine:
            if guard_id in seen and seen[guard_id] != path:
                at = [repr(p) if p else "the root" for p in (seen[guard_id], path)]
                raise UsageError(
                    f"{where}: the sharded modules at {at[0]} and {at[1]} were sharded from "
                    "modules that shared a variable or submodule, and each holds its own copy "
                    "of it: a weight used by both (e.g. a tied embedding) is now two weights, "
                    f"trained apart; {_FIX}.")
        seen.update((g, path) for g in mine)


def _anything_to_check() -> bool:
    """Whether a module that `shard` copied from is still alive, or two live sharded modules
    hold copies of one node (else `check_callers` has nothing to look for)."""
    return any(ref() is not None and (key in _TWINS or any(
        g() is not None for g in guards.values())) for key, (ref, guards) in _SOURCES.items())


#: Frames looked at above a sharded call, at most.
_MAX_FRAMES = 256


def check_callers(where: str) -> None:
    """`check_untied` for every model that a caller of this sharded call holds: the graph
    nodes among the local variables of the calling frames (and inside their tuples, lists
    and dicts), outermost first. A model trained with plain ``nnx.jit`` is a local variable
    of the training loop and of ``nnx.jit`` itself, so a tie broken by `shard` is refused
    wherever the model is called; nothing is changed. Costs a look at the callers' locals
    and a walk of each model's graph, and nothing while no module that `shard` copied from
    is alive."""
    if not _anything_to_check():
        return
    reached: set[int] = set()
    for top in _caller_models(sys._getframe(1)):  # noqa: SLF001 - the callers' models
        if id(top) in reached:
            continue
        walked = _walk(top)
        reached.update(walked)
        check_untied(top, where, walked.values())


#: Items looked at in each local variable that is a container or a plain object.
_MAX_ITEMS = 64


def _caller_models(frame: Any) -> list[Any]:
    """The graph nodes (modules, not variables) that `frame` and its callers hold, outermost
    caller first: their local variables, the items of those that are tuples, lists or dicts,
    and the attributes of those that are plain objects (a trainer holding ``self.model``),
    up to `_MAX_FRAMES` frames."""
    found: dict[int, Any] = {}
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        for value in list(frame.f_locals.values()):
            if isinstance(value, dict):
                items = list(value.values())
            elif isinstance(value, (list, tuple)):
                items = list(value)
            elif nnx.graph.is_graph_node(value) or isinstance(value, (type, ModuleType)):
                items = [value]
            else:  # a plain object: its attributes (a class's are not looked into)
                attributes = getattr(value, "__dict__", None)
                items = [value, *(attributes.values() if isinstance(attributes, dict) else ())]
            for item in items[:_MAX_ITEMS]:
                if nnx.graph.is_graph_node(item) and not isinstance(item, nnx.Variable):
                    found.setdefault(id(item), item)
        frame = frame.f_back
    return list(found.values())[::-1]
