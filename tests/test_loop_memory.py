"""Memory of the layer loop: compiled, under `gtp_jax.shard`'s default config, and where
its gradient stacks are made.

`GTPConfig.remat_gathered=True` (the default) wraps the sharded call in a checkpoint that
re-gathers the unstacked weights (embedding, head) in the backward pass; that checkpoint must
not reach into the layer loop, whose custom VJP chooses its own residuals. When it did, the
loop's residual stacks were saved once per layer and the step's temporary memory grew with
the square of the depth. These tests read XLA's compiled memory analysis (no step runs).
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import get_mesh

import gtp_jax
from gtp_jax.models import Transformer, lm_loss, preset
from gtp_jax.sharding.loop import layer_loop

#: Temporary memory of the default config may exceed ``remat_gathered=False``'s by this
#: factor: the only difference is re-gathering the embedding and head in the backward pass.
REMAT_GATHERED_SLACK = 1.1


def _temp_bytes(layers: int, *, remat: str, prefetch: bool, remat_gathered: bool) -> int:
    """Temporary bytes per device of the compiled gradient of the scanned decoder (tiny
    preset, bf16) on dp2 x gtp4."""
    cfg = preset("tiny", n_layers=layers, dtype=jnp.bfloat16, remat=remat,
                 unroll_layers=False)
    model = gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(0)), get_mesh("dp2_gtp4"),
                          gtp_jax.GTPConfig(prefetch=prefetch, remat_gathered=remat_gathered))
    graphdef, state = nnx.split(model)

    def loss(state: nnx.State, tokens: jax.Array) -> jax.Array:
        return lm_loss(nnx.merge(graphdef, state), tokens)

    tokens = jax.ShapeDtypeStruct((8, 65), jnp.int32)
    compiled = jax.jit(jax.grad(loss)).lower(state, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
@pytest.mark.parametrize("remat", ["none", "dots", "full"])
def test_scanned_loop_memory_is_linear_in_depth_with_default_config(remat, prefetch):
    shallow = _temp_bytes(4, remat=remat, prefetch=prefetch, remat_gathered=True)
    deep = _temp_bytes(8, remat=remat, prefetch=prefetch, remat_gathered=True)
    without = _temp_bytes(8, remat=remat, prefetch=prefetch, remat_gathered=False)
    # Linear growth a + b * L doubles at most when L doubles (a >= 0); quadratic growth
    # (the residual stacks saved per layer) is about 3-4x here.
    assert deep <= 2 * shallow, (remat, prefetch, shallow, deep)
    assert deep <= REMAT_GATHERED_SLACK * without, (remat, prefetch, deep, without)


def _constant_broadcasts(text: str) -> set[str]:
    """The result types (``4x24x24xf32``) of every broadcast of a constant scalar in the
    lowered program `text`: buffers made from nothing, which XLA may allocate anywhere."""
    consts = set(re.findall(r"(%[\w#]+) = stablehlo.constant", text))
    found = re.finditer(r"= stablehlo.broadcast_in_dim (%[\w#]+), dims = \[\] : "
                        r"\(tensor<[^>]*>\) -> tensor<([^>]*)>", text)
    return {m.group(2) for m in found if m.group(1) in consts}


def _tensor_type(shape: tuple[int, ...], dtype: Any) -> str:
    return "x".join(map(str, shape)) + "x" + jnp.dtype(dtype).name.replace("float", "f")


@pytest.mark.parametrize("schedule", ["plain", "prefetch", "unrolled"])
def test_gradient_stacks_are_made_in_the_backward_pass(schedule):
    # The backward pass writes each layer's gradient into a full-size stack. Made from a
    # constant (no operand from the program), a stack may be allocated anywhere, and XLA's
    # GPU scheduler allocated them before the forward pass: every layer's float32 gradient
    # held through it (8 llama3-8b layers on one H200, 2048 tokens: a 31.3 GiB peak, 25.3
    # since). Each stack is made from a value of the backward pass instead.
    n, d = 4, 24
    params = (jnp.ones((n, d, d)), jnp.ones((n, d)))

    def loss(params: Any, x: jax.Array) -> jax.Array:
        h = layer_loop(lambda h, p: jnp.tanh(h @ p[0] + p[1]), x, params, schedule=schedule)
        return jnp.sum(h ** 2)

    text = jax.jit(jax.grad(loss)).lower(params, jnp.ones((2, d))).as_text()
    stacks = {_tensor_type(p.shape, p.dtype) for p in params}
    assert not stacks & _constant_broadcasts(text), (schedule, stacks)


@pytest.mark.parametrize("unroll", [True, False], ids=["unrolled", "scanned"])
def test_sharded_gradient_stacks_are_made_in_the_backward_pass(unroll):
    # The same for the reduce-scattered gradients of weights sharded over gtp (the local
    # shards' stacks) and the replicated stacked parameters beside them.
    n, d = 4, 24
    model = gtp_jax.shard(
        gtp_jax.Stack(lambda r: nnx.Linear(d, d, rngs=r), n, rngs=nnx.Rngs(0), unroll=unroll),
        get_mesh("dp2_gtp4"), gtp_jax.GTPConfig(min_elements=1))
    graphdef, state = nnx.split(model)

    def loss(state: nnx.State, x: jax.Array) -> jax.Array:
        return jnp.sum(nnx.merge(graphdef, state)(x) ** 2)

    text = jax.jit(jax.grad(loss)).lower(state, jnp.ones((8, d))).as_text()
    stacks = {_tensor_type(x.sharding.shard_shape(x.shape), x.dtype)
              for x in jax.tree.leaves(state) if x.ndim >= 2 and x.shape[0] == n}
    assert len(stacks) >= 2, stacks  # the sharded kernel and the replicated bias
    assert not stacks & _constant_broadcasts(text), (unroll, stacks)


@jax.jit
def _jit_cast(x: jax.Array) -> jax.Array:
    return x.astype(jnp.bfloat16)


@pytest.mark.parametrize("schedule", ["unrolled", "plain", "prefetch"])
@pytest.mark.parametrize("use", ["cast", "cast_under_remat", "cast_in_jit", "cast_twice",
                                 "float32"])
def test_unsharded_gradient_stacks_are_kept_in_the_dtype_the_layer_computes_them_in(
        use, schedule):
    # A replicated weight the layer only casts to bfloat16 has a bfloat16 gradient, which the
    # cast's transpose widens; its stack is kept before that widening (half the bytes, where
    # the whole stack is allocated while most saved activations are alive) and widened at
    # the end, exactly. A weight used twice (its widened gradients summed in float32) or in
    # float32 keeps a float32 stack. Every case equals a Python loop's gradients bit for bit.
    n, d = 4, 24
    params = (jax.random.normal(jax.random.key(0), (n, d, d)),
              jax.random.normal(jax.random.key(1), (n, d)))

    def layer(h: jax.Array, p: Any) -> jax.Array:
        w = p[0] if use == "float32" else _jit_cast(p[0]) if use == "cast_in_jit" \
            else p[0].astype(jnp.bfloat16)
        y = h @ w
        if use == "cast_twice":
            y = y + (h * 2) @ p[0].astype(jnp.bfloat16)
        return jnp.tanh(y + p[1]).astype(h.dtype)

    fn = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_saveable) \
        if use == "cast_under_remat" else layer

    def loss(params: Any, x: jax.Array) -> jax.Array:
        return jnp.sum(layer_loop(fn, x, params, schedule=schedule) ** 2)

    def python_loop(params: Any, x: jax.Array) -> jax.Array:
        for i in range(n):
            x = fn(x, (params[0][i], params[1][i]))
        return jnp.sum(x ** 2)

    x = jax.random.normal(jax.random.key(2), (2, d))
    grad = jax.jit(jax.grad(loss))
    for got, want in zip(grad(params, x), jax.jit(jax.grad(python_loop))(params, x)):
        assert got.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    text = grad.lower(params, x).as_text()
    # (the scanned schedules write each layer's slot of the stack; the unrolled one, here on
    # no mesh, stacks the layers' buffers at the end)
    op = "concatenate" if schedule == "unrolled" else "dynamic_update_slice"
    bf16_stack = re.search(rf"stablehlo.{op} .*-> tensor<{n}x{d}x{d}xbf16>", text)
    narrowed = use in ("cast", "cast_under_remat", "cast_in_jit")
    assert bool(bf16_stack) == narrowed, (use, schedule)


@pytest.mark.parametrize("mesh_name", ["gtp8", "dp2_gtp4"])
def test_unrolled_gradients_stay_per_layer_unless_a_data_axis_sums_the_stacks(mesh_name):
    # The unrolled backward pass keeps each layer's gradients in buffers of their own and
    # stacks them once at the end (a concatenation): a stack written slot by slot is
    # allocated whole at the backward pass's start, beside every saved activation
    # (llama3-8b compiled for 2 GPUs, 2048 tokens per GPU: a 58.1 GiB peak, 53.8 by layer).
    # The GTP shards' gradients are summed over a data axis in the loop, layer by layer
    # (`gtp_jax.sharding.data_view`), so they stay per layer under dp too; a replicated
    # per-layer parameter's (the bias here) is summed over dp where the sharded call ends,
    # reading whole stacks: there slots are kept.
    n, d = 4, 24
    model = gtp_jax.shard(
        gtp_jax.Stack(lambda r: nnx.Linear(d, d, rngs=r), n, rngs=nnx.Rngs(0), unroll=True),
        get_mesh(mesh_name), gtp_jax.GTPConfig(min_elements=2 * d))
    graphdef, state = nnx.split(model)

    def loss(state: nnx.State, x: jax.Array) -> jax.Array:
        return jnp.sum(nnx.merge(graphdef, state)(x) ** 2)

    text = jax.jit(jax.grad(loss)).lower(state, jnp.ones((8, d))).as_text()
    kernel = next(x for x in jax.tree.leaves(state) if x.ndim == 3)
    bias = next(x for x in jax.tree.leaves(state) if x.ndim == 2)
    assert bias.sharding.shard_shape(bias.shape) == (n, d)  # replicated: not GTP-sharded

    def made(x: jax.Array, op: str) -> bool:
        stack = _tensor_type(x.sharding.shard_shape(x.shape), x.dtype)
        return bool(re.search(rf"stablehlo.{op} .*-> tensor<{stack}>", text))

    assert made(kernel, "concatenate") and not made(kernel, "dynamic_update_slice"), mesh_name
    data_axis = mesh_name != "gtp8"
    assert made(bias, "dynamic_update_slice") == data_axis, mesh_name
    assert made(bias, "concatenate") == (not data_axis), mesh_name
