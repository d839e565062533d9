"""`gtp_jax.Stack`: any NNX block on the library's layer loop, against the unsharded model
and Flax's own stacked-layer idiom (``nnx.vmap`` to build, ``nnx.scan`` to apply).

Every sharded run is on dp2 x gtp4 with dims that do not divide the 4 GTP shards (38, 50,
29, 7: every stacked kernel is padded), blocks that keep state (an example count, a running
mean, a dropout's RNG stream) and read a layer outside the stack (the embedding, handed to
the call). Float32 throughout: sharded and unsharded runs differ in reduction order only,
the bound of tests/test_equivalence.py (1e-5 relative).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_close, get_mesh, max_rel_err, mse_loss

import gtp_jax
from gtp_jax import pallas
from gtp_jax.sharding import fp8
from gtp_jax.train import replicate_stray_leaves

#: The sharded runs (tens of seconds on 2 cores): `pytest -m "not slow"` skips them.
slow = pytest.mark.slow

D, F, V, OUT, N = 38, 50, 29, 7, 3  # model dims (none divides 4), layers
BATCH, SEQ, STEPS = 16, 5, 3
RTOL = 1e-5  # float32, reduction order only
FULL = jax.checkpoint_policies.nothing_saveable
DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


class Block(nnx.Module):
    """A pre-norm MLP block that keeps state (examples seen, a running mean of its input, a
    dropout's RNG stream) and reads the embedding it is handed (a tie to a layer outside
    the stack)."""

    def __init__(self, rngs: nnx.Rngs, rate: float = 0.0):
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, F, rngs=rngs)
        self.down = nnx.Linear(F, D, use_bias=False, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.seen = gtp_jax.BatchSum(jnp.zeros((), jnp.int32))
        self.avg = gtp_jax.BatchMean(jnp.zeros((D,)))

    def __call__(self, x: jax.Array, embed: nnx.Embed) -> jax.Array:
        self.seen[...] += x.shape[0]
        self.avg[...] = 0.9 * self.avg[...] + 0.1 * jnp.mean(x, (0, 1))
        h = self.down(jax.nn.gelu(self.up(self.norm(x))))
        tied = embed.attend(x) @ embed.embedding[...]
        return x + self.drop(h) + 0.01 * tied


class Model(nnx.Module):
    """Tokens ``[batch, seq]`` -> ``[batch, seq, OUT]``: embedding, a `Stack` of `Block`s
    handed the embedding, a head."""

    def __init__(self, rngs: nnx.Rngs, rate: float = 0.0, **stack):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.blocks = gtp_jax.Stack(lambda r: Block(r, rate), N, rngs=rngs, **stack)
        self.head = nnx.Linear(D, OUT, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.head(self.blocks(self.embed(tokens), self.embed))


def _batches(key: jax.Array) -> list[jax.Array]:
    return [jax.random.randint(jax.random.fold_in(key, i), (BATCH, SEQ), 0, V)
            for i in range(STEPS)]


def _flat(state: nnx.State) -> dict[str, np.ndarray]:
    return {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(state)}


def _train(model: nnx.Module, batches: list[jax.Array], mesh=None) -> list:
    """AdamW steps; per step (loss, {path: gradient}) with unsharded gradients."""
    opt = nnx.Optimizer(model, optax.adamw(1e-2, eps=1e-3), wrt=nnx.Param)
    if mesh is not None:
        replicate_stray_leaves(opt, mesh)  # the step compiles once, not twice

    @nnx.jit
    def step(m, o, tokens):
        loss, grads = nnx.value_and_grad(mse_loss)(m, tokens)
        o.update(m, grads)
        return loss, grads

    out = []
    for tokens in batches:
        if mesh is not None:
            tokens = jax.device_put(tokens, gtp_jax.data_sharding(mesh))
        loss, grads = step(model, opt, tokens)
        grads = (gtp_jax.unshard_values(model, grads) if mesh is not None
                 else _flat(nnx.state(grads, nnx.Param)))
        out.append((float(loss), {k: np.asarray(v) for k, v in grads.items()}))
    return out


@pytest.fixture(scope="module")
def reference():
    """The unsharded model's run: its steps, then its parameters and layer state."""
    model = Model(nnx.Rngs(7))
    steps = _train(model, _batches(jax.random.key(11)))
    return steps, _flat(nnx.state(model, nnx.Param)), model.blocks.layers


def _gathered_shapes(jaxpr) -> list[tuple[int, ...]]:
    """Output shapes of every all-gather in `jaxpr` and the jaxprs inside it."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("all_gather"):
            shapes += [tuple(v.aval.shape) for v in eqn.outvars]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            shapes += _gathered_shapes(sub)
    return shapes


@slow
@pytest.mark.parametrize(("stack", "config"), [
    (dict(unroll=False), {}),
    (dict(unroll=False, remat=DOTS), dict(prefetch=True, keep_gathered_layers=True)),
    (dict(unroll=True, remat=FULL), {}),
], ids=["scanned", "scanned_prefetch_dots_kept", "unrolled_full"])
def test_sharded_stack_trains_like_the_unsharded_one(reference, stack, config):
    mesh = get_mesh("dp2_gtp4")
    sm = gtp_jax.shard(Model(nnx.Rngs(7), **stack), mesh,
                       gtp_jax.GTPConfig(min_elements=0, **config))
    stacked = [p for p in sm.plan if p.stacked]
    assert {p.path for p in stacked} >= {"blocks/layers/up/kernel", "blocks/layers/down/kernel"}
    assert all(p.spec.padded_size > p.spec.logical_shape[p.spec.shard_dim] for p in stacked
               if p.path.endswith("kernel"))
    # The layer loop gathers one layer at a time: each stacked weight's per-layer shape is
    # gathered, never the whole stack, in the forward and the backward pass.
    tokens = jax.device_put(_batches(jax.random.key(11))[0], gtp_jax.data_sharding(mesh))
    graphdef, state = nnx.split(sm)
    jaxpr = jax.make_jaxpr(lambda s: nnx.grad(mse_loss)(nnx.merge(graphdef, s), tokens))(state)
    gathered = _gathered_shapes(jaxpr.jaxpr)
    # one per layer (the default): all of a layer's shards as one [gtp, total] buffer
    layer = (stacked[0].spec.axis_size, sum(math.prod(p.spec.shard_shape) for p in stacked))
    assert layer in gathered, (layer, gathered)
    assert (layer[0], N * layer[1]) not in gathered  # never the whole stack's shards
    for p in stacked:
        assert (N, *p.spec.padded_shape) not in gathered, p.path

    ref_steps, ref_params, ref_layers = reference
    steps = _train(sm, _batches(jax.random.key(11)), mesh)
    for i, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(steps, ref_steps)):
        assert_close(loss, ref_loss, RTOL, f"step {i} loss")
        assert set(grads) == set(ref_grads)
        for path, g in ref_grads.items():
            assert_close(grads[path], g, RTOL, f"step {i} grad {path}")
    params = gtp_jax.unshard_values(sm, sm)
    for path, p in ref_params.items():
        assert_close(params[path], p, RTOL, f"{path} after {STEPS} steps")
    # State the blocks wrote, combined over the 8 data shards by its type's rule: every
    # layer saw every example of every step (BatchSum), and the running means are those
    # of the whole batches (BatchMean).
    layers = sm.module.blocks.layers
    np.testing.assert_array_equal(layers.seen[...], np.full(N, BATCH * STEPS))
    np.testing.assert_array_equal(layers.seen[...], ref_layers.seen[...])
    assert_close(layers.avg[...], ref_layers.avg[...], RTOL, "running mean")


def _fold(keys: jax.Array, shard: jax.Array) -> jax.Array:
    return jax.vmap(lambda k: jax.random.fold_in(k, shard))(keys)


@slow
def test_dropout_draws_per_layer_and_per_data_shard(seed, key):
    # A sharded call folds the module's RNG keys per data shard (docs/shard_contract.md,
    # randomness): each shard draws its own masks. So the reference is the unsharded model
    # run on each shard's rows with that shard's folded keys; the scanned loop recomputes
    # each layer in the backward pass (remat saves nothing), which must redraw the same
    # masks.
    mesh = get_mesh("dp2_gtp4")
    model = Model(nnx.Rngs(seed), rate=0.5, unroll=False, remat=FULL)
    keys = jax.random.key_data(model.blocks.layers.drop.rngs.key[...])
    assert len({tuple(np.asarray(k).ravel()) for k in keys}) == N  # a stream per layer
    graphdef, params, rest = nnx.split(nnx.clone(model), nnx.Param, ...)
    sm = gtp_jax.shard(model, mesh, gtp_jax.GTPConfig(min_elements=0))
    tokens = jax.random.randint(key, (BATCH, SEQ), 0, V)
    loss, grads = nnx.jit(nnx.value_and_grad(mse_loss))(
        sm, jax.device_put(tokens, gtp_jax.data_sharding(mesh)))

    @jax.jit
    def per_shard(params, rest, tokens):
        def mean_loss(p):
            def one(shard, rows):
                folded = jax.tree.map(lambda x: _fold(x, shard) if jnp.issubdtype(
                    x.dtype, jax.dtypes.prng_key) else x, rest)
                return mse_loss(nnx.merge(graphdef, p, folded), rows)
            rows = tokens.reshape(8, BATCH // 8, SEQ)  # shard i holds rows block i
            return jnp.mean(jax.vmap(one)(jnp.arange(8, dtype=jnp.uint32), rows))
        return jax.value_and_grad(mean_loss)(params)

    ref_loss, ref_grads = per_shard(params, rest, tokens)
    assert_close(loss, ref_loss, RTOL, "loss")
    got = gtp_jax.unshard_values(sm, grads)
    for path, g in _flat(ref_grads).items():
        assert_close(got[path], g, RTOL, path)
    # each layer drew once; the count is the same on every shard (RngCount: kept as is)
    np.testing.assert_array_equal(sm.module.blocks.layers.drop.rngs.count[...], np.ones(N))
    # and the draws are not one mask for every shard: without the fold the loss differs
    unfolded = jax.jit(lambda p, r, t: mse_loss(nnx.merge(graphdef, p, r), t))(
        params, rest, tokens)
    assert max_rel_err(loss, unfolded) > 1e-4


def _qdq(weight: jax.Array, spec, stacked: bool) -> jax.Array:
    """What every device holds after the low-precision gather of `weight` (full, logical)."""
    def one(w):
        q = pallas.quantize(w, spec.gather_format, dim=spec.block_axis, backend="reference")
        return pallas.dequantize(q, spec.compute_dtype, backend="reference")

    return jnp.stack([one(w) for w in weight]) if stacked else one(weight)


@slow
def test_low_precision_gathers_match_the_quantized_model(seed, key):
    # mxfp8 gathers, one scale per layer's weight as the loop gathers them: the model run on
    # quantize -> dequantize of its full weights (tests/test_lowp_gather.py's reference).
    mesh = get_mesh("dp2_gtp4")
    model = Model(nnx.Rngs(seed), unroll=False, prefetch=True)
    ref = nnx.clone(model)
    sm = gtp_jax.shard(model, mesh, gtp_jax.GTPConfig(min_elements=0, gather_format="mxfp8",
                                                      quant_backend="reference"))
    plans = {p.path: p for p in sm.plan if p.spec.quantized}
    assert any(p.stacked for p in plans.values())
    for path, var in _flat_vars(ref).items():
        if path in plans:
            var.set_value(_qdq(var.get_value(), plans[path].spec, plans[path].stacked))
    tokens = jax.random.randint(key, (BATCH, SEQ), 0, V)
    loss, grads = nnx.jit(nnx.value_and_grad(mse_loss))(
        sm, jax.device_put(tokens, gtp_jax.data_sharding(mesh)))
    ref_loss, ref_grads = nnx.jit(nnx.value_and_grad(mse_loss))(ref, tokens)
    assert_close(loss, ref_loss, RTOL, "loss")
    got = gtp_jax.unshard_values(sm, grads)
    for path, g in _flat(nnx.state(ref_grads, nnx.Param)).items():
        assert_close(got[path], g, RTOL, path)


def _flat_vars(module: nnx.Module) -> dict[str, nnx.Variable]:
    by_path = {tuple(p): v for p, v in nnx.iter_graph(module) if isinstance(v, nnx.Variable)}
    return {"/".join(map(str, k)): by_path[tuple(k)]
            for k, _ in nnx.to_flat_state(nnx.state(module, nnx.Param))}


@slow
def test_fp8_compute_reaches_the_blocks_projections(seed, key):
    # The blocks' nnx.Linear layers compute in FP8 inside the loop, fed the FP8 payloads
    # they were gathered as: the unsharded model with the same recipe on each data shard's
    # rows (per-device scales; tests/test_fp8_compute.py's reference).
    mesh = get_mesh("dp2_gtp4")
    config = gtp_jax.GTPConfig(min_elements=0, fp8_compute="tensorwise", fp8_min_features=0,
                               gather_format="fp8")
    model = Model(nnx.Rngs(seed), unroll=True)
    ref = nnx.clone(model)
    sm = gtp_jax.shard(model, mesh, config)
    assert {"blocks/layers/up", "blocks/layers/down"} <= {p for p, _, _ in sm.fp8_layers}
    assert {p.path for p in sm.plan if p.spec.fp8_in_dims} >= {
        "blocks/layers/up/kernel", "blocks/layers/down/kernel"}
    fp8.inject(ref, fp8.fp8_layers(ref, config))
    graphdef, params, rest = nnx.split(ref, nnx.Param, ...)
    tokens = jax.random.randint(key, (BATCH, SEQ), 0, V)
    loss, grads = nnx.jit(nnx.value_and_grad(mse_loss))(
        sm, jax.device_put(tokens, gtp_jax.data_sharding(mesh)))

    @jax.jit
    def per_shard(params, rest, tokens):
        def mean_loss(p):
            rows = tokens.reshape(8, BATCH // 8, SEQ)
            def one(rows):  # the blocks write their state: fresh variables in this trace
                return mse_loss(nnx.merge(graphdef, p, jax.tree.map(lambda x: x, rest)), rows)
            return jnp.mean(jax.vmap(one)(rows))
        return jax.value_and_grad(mean_loss)(params)

    ref_loss, ref_grads = per_shard(params, rest, tokens)
    rtol = 2e-4  # float32 reduction order, with a few FP8 rounding flips in long sums
    assert_close(loss, ref_loss, rtol, "loss")
    got = gtp_jax.unshard_values(sm, grads)
    for path, g in _flat(ref_grads).items():
        assert_close(got[path], g, rtol, path)


@slow
def test_delayed_fp8_keeps_one_amax_history_per_layer(seed, key):
    # Delayed scaling: each layer of the stack records its own amaxes (the histories are
    # stacked like the kernels, and their "gradient", the next history, comes out of the
    # loop per layer): every layer ran once per step, and its weight amax is that layer's
    # own max |kernel|, exactly.
    from gtp_jax.base.fp8_history import HISTORY_COLUMNS, Fp8History

    mesh = get_mesh("dp2_gtp4")
    sm = gtp_jax.shard(Model(nnx.Rngs(seed), unroll=False), mesh, gtp_jax.GTPConfig(
        min_elements=0, fp8_compute="delayed", fp8_min_features=0))
    tokens = jax.device_put(jax.random.randint(key, (BATCH, SEQ), 0, V),
                            gtp_jax.data_sharding(mesh))
    wrt = nnx.Any(nnx.Param, Fp8History)

    @nnx.jit
    def step(m, t):
        return gtp_jax.apply_fp8_history(
            m, nnx.grad(mse_loss, argnums=nnx.DiffState(0, wrt))(m, t))

    for _ in range(2):
        uses = step(sm, tokens)
    assert {k: float(v) for k, v in uses.items()} == {"blocks/layers/up": 1.0,
                                                      "blocks/layers/down": 1.0}
    kernels = gtp_jax.unshard_values(sm, sm)
    w = HISTORY_COLUMNS.index("w")
    for name in ("up", "down"):
        history = np.asarray(getattr(sm.module.blocks.layers, name).dot_general
                             .amax_history[...])
        assert history.shape[0] == N
        np.testing.assert_array_equal(history[:, :2, HISTORY_COLUMNS.index("uses")], 1.0)
        want = np.abs(kernels[f"blocks/layers/{name}/kernel"]).max(axis=(1, 2))
        np.testing.assert_array_equal(history[:, 0, w], want)
        assert len(set(want.tolist())) == N  # the layers' own, not one for all


@slow
def test_shard_init_builds_a_stack_where_it_lives(seed):
    # shard_init(make) is shard(make()), built in its sharded layout: the same values, RNG
    # keys and counts bit for bit, and the same metadata (gtp_stacked on every variable).
    # Floats to the last bit only: under this suite's --xla_cpu_use_fusion_emitters=false
    # two kernels' truncated-normal inits differ by 1 ulp from the eager ones, as they do
    # for the same model written in Flax's own idiom without a Stack.
    mesh = get_mesh("dp2_gtp4")
    config = gtp_jax.GTPConfig(min_elements=0)
    built = gtp_jax.shard_init(lambda: Model(nnx.Rngs(seed), rate=0.1), mesh, config)
    want = gtp_jax.shard(Model(nnx.Rngs(seed), rate=0.1), mesh, config)
    assert built.describe() == want.describe()
    got, ref = _bits(nnx.state(built)), _bits(nnx.state(want))
    assert got.keys() == ref.keys()
    for k, v in ref.items():
        if np.issubdtype(v.dtype, np.floating):
            np.testing.assert_allclose(got[k], v, rtol=2**-22, atol=0, err_msg=str(k))
        else:
            np.testing.assert_array_equal(got[k], v, err_msg=str(k))
    metadata = {tuple(k): v.get_metadata() for k, v in nnx.to_flat_state(nnx.state(want))}
    for k, v in nnx.to_flat_state(nnx.state(built)):
        assert v.get_metadata() == metadata[tuple(k)], k
        if "layers" in k:
            assert v.get_metadata()["gtp_stacked"], k


# --------------------------------------------------------------------------- Flax's idiom


class SmallBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(6, 6, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.drop(jnp.tanh(self.lin(x)))


class FlaxIdiom(nnx.Module):
    """A stack of layers as Flax's own documentation writes it (``nnx.scan``'s example)."""

    def __init__(self, n: int, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=n)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_block(rngs: nnx.Rngs) -> SmallBlock:
            return SmallBlock(rngs)

        self.blocks = create_block(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        return forward(x, self.blocks)


class OnStack(nnx.Module):
    """`FlaxIdiom` moved over: the stack is built by one line, applied by a call."""

    def __init__(self, n: int, rngs: nnx.Rngs, unroll: bool = False):
        self.blocks = gtp_jax.Stack(SmallBlock, n, rngs=rngs, unroll=unroll)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.blocks(x)


def _bits(tree: nnx.State, tail: int = 0) -> dict[tuple, np.ndarray]:
    """``{path: bits}`` of every variable (keys as their key data); `tail`: keep only the
    last that many keys of each path (the stack's paths have one more: ``layers``)."""
    out = {}
    for k, v in nnx.to_flat_state(tree):
        x = v.get_value()
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out[tuple(k)[-tail:]] = np.asarray(x)
    return out


def test_a_model_in_flax_idiom_moves_over_with_the_same_numbers(seed, key):
    # Unsharded, a stack is a plain loop: the same parameter bits as Flax's idiom from the
    # same Rngs, the same dropout masks and RNG counts after the call, and the same outputs
    # and gradients to float32 rounding (bit for bit with jaxlib 0.10's CPU compiler; its
    # 0.11 fuses the two programs differently: outputs a few ulps apart).
    x = jax.random.normal(key, (4, 6))

    def loss(m, x):
        return jnp.sum(jnp.sin(m(x)))

    flax_model = FlaxIdiom(3, nnx.Rngs(seed))
    want = _bits(nnx.state(flax_model), tail=2)
    y_ref = flax_model(x)
    g_ref = _bits(nnx.grad(loss)(flax_model, x), tail=2)
    for unroll in (False, True):
        model = OnStack(3, nnx.Rngs(seed), unroll=unroll)
        got = _bits(nnx.state(model), tail=2)
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))
        assert_close(model(x), y_ref, 1e-6, "outputs")
        grads = _bits(nnx.grad(loss)(model, x), tail=2)
        for k, g in g_ref.items():
            assert_close(grads[k], g, 1e-6, str(k))
        # two calls each, one draw per layer per call
        np.testing.assert_array_equal(model.blocks.layers.drop.rngs.count[...],
                                      flax_model.blocks.drop.rngs.count[...])


# --------------------------------------------------------------------------- refusals


class Holder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, shared: nnx.Module):
        self.lin = nnx.Linear(4, 4, rngs=rngs)
        self.shared = shared


def test_a_block_holding_a_layer_from_outside_the_stack_is_refused():
    # The copy each layer would get would untie it: refused, pointing at the call instead.
    outside = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    with pytest.raises(gtp_jax.UsageError, match="made outside make_block.*stack\\(x, shared\\)"):
        gtp_jax.Stack(lambda r: Holder(r, outside), 2, rngs=nnx.Rngs(1))


class Rows(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(2, 2, rngs=rngs)
        self.last = gtp_jax.PerExample(jnp.zeros((16, 2)))


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(make_block=nnx.Linear(2, 2, rngs=nnx.Rngs(0))), "make_block must be a function"),
    (dict(make_block=3), "make_block must be a function"),
    (dict(n=0), "n=0 must be a positive int"),
    (dict(n=True), "n=True must be a positive int"),
    (dict(rngs=0), "rngs must be an nnx.Rngs"),
    (dict(remat="full"), "remat='full' must be a jax.checkpoint policy"),
    (dict(unroll=1), "unroll=1 must be True, False or None"),
    (dict(prefetch="yes"), "prefetch='yes' must be True, False or None"),
    (dict(make_block=lambda r: jnp.zeros(2)), "make_block returned a .*Array"),
    (dict(make_block=lambda r: Rows(r)), "'last' is per-example state"),
])
def test_stack_arguments_are_checked(kwargs, match):
    args = dict(make_block=lambda r: nnx.Linear(2, 2, rngs=r), n=2, rngs=nnx.Rngs(0)) | kwargs
    with pytest.raises(gtp_jax.UsageError, match=match):
        gtp_jax.Stack(args.pop("make_block"), args.pop("n"), **args)


class Misbehaving(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, mode: str):
        self.lin = nnx.Linear(4, 4, rngs=rngs)
        self.count = gtp_jax.BatchSum(jnp.zeros((), jnp.int32))
        self.mode = mode

    def __call__(self, x: jax.Array, other: nnx.Module | None = None) -> jax.Array:
        if self.mode == "sow":
            self.sow(nnx.Intermediate, "h", x)
        elif self.mode == "param":
            self.lin.kernel[...] = 2 * self.lin.kernel[...]
        elif self.mode == "state_dtype":
            self.count.set_value(self.count[...].astype(jnp.float32))
        elif self.mode == "handed":
            other.count[...] += 1
        elif self.mode == "carry":
            return self.lin(x).astype(jnp.bfloat16)
        return self.lin(x)


@pytest.mark.parametrize(("mode", "match"), [
    ("sow", "added the variable 'h' in __call__"),
    ("param", "wrote its 'lin/kernel' in __call__"),
    ("state_dtype", "changed its 'count' from int32\\[\\] to float32\\[\\]"),
    ("handed", "wrote to a module or variable it was handed in the call"),
    ("carry", "returned bfloat16\\[2,4\\] for the carry float32\\[2,4\\]"),
])
def test_what_a_block_cannot_do_in_its_call_is_refused_before_anything_changes(mode, match):
    stack = gtp_jax.Stack(lambda r: Misbehaving(r, mode), 2, rngs=nnx.Rngs(0))
    other = Misbehaving(nnx.Rngs(1), "none")
    before = _bits(nnx.state(stack))
    with pytest.raises(gtp_jax.UsageError, match=match):
        stack(jnp.ones((2, 4)), other)
    after = _bits(nnx.state(stack))
    for k, v in before.items():
        np.testing.assert_array_equal(after[k], v, err_msg=str(k))
    assert int(other.count[...]) == 0


class Remat(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.inner = SmallBlock(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return nnx.remat(lambda m, h: m(h))(self.inner, x)


def test_lifted_transforms_inside_a_block_only_pass_its_variables_on():
    # nnx.remat hands back every variable of the block as a new value: not a write of the
    # parameters or keys; the dropout's count it really advanced is written back.
    stack = gtp_jax.Stack(Remat, 2, rngs=nnx.Rngs(0))
    plain = gtp_jax.Stack(SmallBlock, 2, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 6))
    np.testing.assert_array_equal(stack(x), plain(x))
    np.testing.assert_array_equal(stack.layers.inner.drop.rngs.count[...], [1, 1])


def test_unsharded_unrolled_backward_cuts_its_layer_slices_behind_the_gradient():
    # An unwrapped stack (no gtp_jax.shard) slices each layer's weights out of the stacks.
    # The backward pass cuts its slices anew, tied to the gradient input by a barrier, and
    # ties each layer's written gradient slot to it too: else XLA merges them with the
    # forward pass's identical slices and keeps every layer's slice alive from the forward
    # to the backward pass (1x H200, a user's 1b-shaped decoder: 19.4 against 18.8 GiB,
    # the bundled 1b unwrapped 21.2 against 19.6 GiB). The program before XLA's passes
    # shows the barriers (XLA's CPU compiler removes them before it merges, so the CPU's
    # memory analysis cannot show the saving).
    n, d = 4, 16
    model = gtp_jax.Stack(lambda r: nnx.Linear(d, d, rngs=r), n, rngs=nnx.Rngs(0),
                          unroll=True)
    graphdef, state = nnx.split(model)

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x) ** 2)

    text = jax.jit(jax.grad(loss)).lower(state, jnp.ones((2, d))).as_text()
    stacked = f"tensor<{n}x{d}x{d}xf32>"
    tied = [line for line in text.splitlines()
            if "optimization_barrier" in line and stacked in line]
    assert len(tied) >= n, len(tied)  # before each layer's slices


class _GatedBlock(nnx.Module):
    """A block with weak-typed per-layer parameters (``jnp.array(0.5)``, ``jnp.full``)."""

    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(64, 64, rngs=rngs)
        self.gate = nnx.Param(jnp.array(0.5))
        self.scale = nnx.Param(jnp.full((64,), 0.5))

    def __call__(self, x):
        return x + self.gate[...] * jnp.tanh(self.lin(x)) * self.scale[...]


class _Gated(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, unroll: bool):
        self.blocks = gtp_jax.Stack(_GatedBlock, 3, rngs=rngs, unroll=unroll)

    def __call__(self, x):
        return self.blocks(x)


@pytest.mark.parametrize("unroll,prefetch", [(False, False), (False, True), (True, False)])
def test_weak_typed_layer_parameters_train_as_unsharded(unroll, prefetch):
    # Weak-typed replicated parameters in the layer loop: their slices are traced with
    # their weak type (the scanned loop's gradient refused them before).
    x = jax.random.normal(jax.random.key(1), (16, 64))

    def loss(m, x):
        return jnp.mean(m(x) ** 2)

    ref = nnx.grad(loss)(_Gated(nnx.Rngs(0), unroll), x)
    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    sm = gtp_jax.shard(_Gated(nnx.Rngs(0), unroll), mesh, gtp_jax.GTPConfig(prefetch=prefetch))
    got = gtp_jax.unshard_values(sm, nnx.grad(loss)(sm, jax.device_put(
        x, gtp_jax.data_sharding(mesh, 2))))
    for name in ("gate", "scale"):
        np.testing.assert_allclose(np.asarray(got[f"blocks/layers/{name}"]),
                                   np.asarray(getattr(ref.blocks.layers, name)[...]),
                                   rtol=1e-5, atol=1e-6)


class _OwnStacked(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (3, 64, 64)) * 0.1,
                           gtp_stacked=True)

    def __call__(self, x):
        return gtp_jax.scan_layers(lambda h, w: h + jnp.tanh(h @ w), x, self.w[...])


def test_a_stacked_weight_read_with_ellipsis_reaches_scan_layers():
    # `self.w[...]`, Flax's way to read a Variable, hands scan_layers the weight itself.
    x = jax.random.normal(jax.random.key(1), (16, 64))
    sm = gtp_jax.shard(_OwnStacked(nnx.Rngs(0)), gtp_jax.make_mesh(dp=2, gtp=4))
    np.testing.assert_allclose(np.asarray(sm(x)), np.asarray(_OwnStacked(nnx.Rngs(0))(x)),
                               rtol=1e-5, atol=1e-5)
