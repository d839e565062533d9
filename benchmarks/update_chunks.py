"""Does the trainer's clipped AdamW update need temporary memory, and would updating the
layer stacks one layer at a time (in chunks) need less?

Compiles both forms of one update of a stacked parameter tree (32 layers of D float32 each,
a quarter-size second stack, one unstacked leaf) with the parameters and state donated,
prints XLA's temporary bytes for each, and checks that both compute the same bits.

    python benchmarks/update_chunks.py 33554432     # on a GPU: 20.5 GiB of arguments
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax

from gtp_jax.sharding.offload import _masked, _param_shaped, stream_units
from gtp_jax.train.step.optim import make_optimizer

LAYERS = 32


def whole(tx: Any, params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
    """The update as the training step runs it: optax on the whole trees."""
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def chunked(tx: Any, stacked: Any, params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
    """The same update, clipping on the whole tree, then AdamW one layer of every stack at a
    time, each layer's step behind the previous one's results (an optimization barrier)
    and written into the stacks in place."""
    global_state, leaf_state = state
    updates, new_global = tx.global_part.update(grads, global_state, params)
    p_cur, p_def = jax.tree.flatten(params)
    u_leaves = p_def.flatten_up_to(updates)
    shaped = _param_shaped(p_def)
    parts, s_def = jax.tree.flatten(leaf_state, is_leaf=shaped)
    moments = {(j, i): x for j, part in enumerate(parts) if shaped(part)
               for i, x in enumerate(p_def.flatten_up_to(part))}
    moment_parts = sorted({j for j, _ in moments})
    others = {j: x for j, x in enumerate(parts) if not shaped(x)}
    new_others: dict[int, Any] = {}
    gate = None

    def cut(x: jax.Array, span: Any) -> jax.Array:
        return x if span is None else jax.lax.slice_in_dim(x, span[0], span[1])

    def put(buf: jax.Array, value: jax.Array, span: Any) -> jax.Array:
        return value if span is None else jax.lax.dynamic_update_slice_in_dim(
            buf, value, span[0], 0)

    for unit in stream_units(params, stacked, 1):
        keys = [(j, i) for j in moment_parts for i, _ in unit]
        bufs = ([p_cur[i] for i, _ in unit], [moments[k] for k in keys])
        if gate is not None:
            bufs, _ = jax.lax.optimization_barrier((bufs, gate))
        for (i, _), b in zip(unit, bufs[0]):
            p_cur[i] = b
        moments.update(zip(keys, bufs[1]))
        s_tree = s_def.unflatten([
            _masked(p_def, {i: cut(moments[(j, i)], span) for i, span in unit})
            if j in moment_parts else others[j] for j in range(len(parts))])
        p_tree = _masked(p_def, {i: cut(p_cur[i], span) for i, span in unit})
        g_tree = _masked(p_def, {i: cut(u_leaves[i], span) for i, span in unit})
        out_u, out_s = tx.leafwise_part.update(g_tree, s_tree, p_tree)
        new_p = p_def.flatten_up_to(optax.apply_updates(p_tree, out_u))
        out_parts = s_def.flatten_up_to(out_s)
        gate = []
        for i, span in unit:
            p_cur[i] = put(p_cur[i], new_p[i], span)
            gate.append(new_p[i])
            for j in moment_parts:
                y = p_def.flatten_up_to(out_parts[j])[i]
                moments[(j, i)] = put(moments[(j, i)], y, span)
                gate.append(y)
        new_others = new_others or {j: out_parts[j] for j in others}
    new_leaf = s_def.unflatten([
        p_def.unflatten([moments[(j, i)] for i in range(len(p_cur))]) if j in moment_parts
        else new_others[j] for j in range(len(parts))])
    return p_def.unflatten(p_cur), (new_global, new_leaf)


def main(width: int) -> None:
    params = {"a": jnp.ones((LAYERS, width)), "b": jnp.ones((LAYERS, width // 4)),
              "e": jnp.ones((width,))}
    stacked = {"a": True, "b": True, "e": False}
    tx = make_optimizer(1e-3, 1, 10, 0.1)
    state = tx.init(params)
    grads = jax.tree.map(lambda x: x * 0.5, params)
    forms = {"whole": lambda p, s, g: whole(tx, p, s, g),
             "chunked": lambda p, s, g: chunked(tx, stacked, p, s, g)}
    for name, fn in forms.items():
        m = jax.jit(fn, donate_argnums=(0, 1)).lower(params, state, grads).compile() \
            .memory_analysis()
        print(f"{name}: temp {m.temp_size_in_bytes / 2**20:.2f} MiB, arguments "
              f"{m.argument_size_in_bytes / 2**20:.0f} MiB ({jax.devices()[0].device_kind})")
    a = jax.jit(forms["whole"])(params, state, grads)
    b = jax.jit(forms["chunked"])(params, state, grads)
    print("same bits:", all(bool((x == y).all())
                            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 65536)
