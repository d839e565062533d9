"""Master weights in host memory (`GTPConfig.offload_master_weights`): the float32
parameters travel with the offloaded optimizer state, the device holds them (and their
gradients) in bfloat16.

The reference is the same sharded model trained on the device by that mixed-precision
recipe, written out here: bfloat16 parameters and gradients on the device, AdamW updating
a float32 master kept beside them, the parameters set to the new master rounded to
bfloat16. The offloaded step must give the same losses, master, moments and parameters
bit for bit: the arithmetic is the same, only where the values live differs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import gtp_jax
from gtp_jax.__main__ import main as gtp_jax_main
from gtp_jax.base.errors import UsageError
from gtp_jax.models import lm_loss
from gtp_jax.sharding.module import hold_params_in
from gtp_jax.sharding.offload import (
    DEFAULT_GROUP_LAYERS,
    HOST_MEMORY_KIND,
    MasterState,
    StreamableChain,
    host_bytes_per_device,
    with_master_weights,
)
from gtp_jax.train import TrainConfig
from gtp_jax.train.config import make_optimizer
from gtp_jax.train.lifecycle.checkpoint import CheckpointConfig, Checkpointer
from gtp_jax.train.loop import build_model_and_optimizer
from gtp_jax.train.step.memory import memory_bound, pinned_host_bound
from gtp_jax.train.step.train_step import TrainStep, group_offloaded, make_nnx_optimizer

#: Two layers (the tiny preset has four): master weights treat every layer alike.
CFG = TrainConfig(preset="tiny", batch_size=8, seq_len=32, dp=2, gtp=4, steps=3, warmup=1,
                  offload_optimizer=True, offload_master_weights=True, layers=2)
LOSS = functools.partial(lm_loss, aux_weight=0.0)
BF16 = jnp.bfloat16


def _batches(cfg: TrainConfig) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (cfg.batch_size, cfg.seq_len + 1), dtype=np.int32)
            for _ in range(cfg.steps)]


def _rounded(x: jax.Array) -> jax.Array:
    return x.astype(BF16).astype(x.dtype)


def _reference_tx(tx: StreamableChain) -> optax.GradientTransformation:
    """`tx` on a float32 master kept in the state; the bfloat16 parameters are set to the
    new master rounded to bfloat16 (a float32 update ``rounded - p``: both are bfloat16
    values, so the difference and ``p + update`` are exact in float32)."""

    def init(params):
        return tx.init(params), jax.tree.map(lambda p: p.astype(jnp.float32), params)

    def update(grads, state, params):
        inner, master = state
        u, inner = tx.update(grads, inner, master)
        master = optax.apply_updates(master, u)
        return (jax.tree.map(lambda m, p: _rounded(m) - p.astype(m.dtype), master, params),
                (inner, master))

    return optax.GradientTransformation(init, update)


def _reference(cfg: TrainConfig) -> tuple[list[float], nnx.Module, nnx.Optimizer]:
    on_device = dataclasses.replace(cfg, offload_optimizer=False, offload_master_weights=False)
    model, _ = build_model_and_optimizer(on_device)
    optimizer = nnx.Optimizer(model, _reference_tx(make_optimizer(on_device)), wrt=nnx.Param)
    hold_params_in(model, BF16)
    step = TrainStep(model, optimizer, LOSS, grad_accum=cfg.grad_accum)
    losses = [float(step(tokens)["loss"]) for tokens in _batches(cfg)]
    step.sync()
    return losses, model, optimizer


#: The scanned loop with two microbatches per step (their gradient sum is carried in
#: float32 and rounded to bfloat16 once). The layer loop only changes the forward and
#: backward passes, which master weights leave alone; the unrolled loop and a user's own
#: module are in `test_a_users_module_trains_with_master_weights_like_the_reference` and
#: the other tests here.
CASES = {"scanned_accum2": dataclasses.replace(CFG, unroll_layers=False, grad_accum=2,
                                               batch_size=16)}


def _flat(state: nnx.State) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(state)}


def _master_of(optimizer: nnx.Optimizer) -> MasterState:
    (_, leaf_state) = optimizer.opt_state
    assert isinstance(leaf_state, MasterState)
    return leaf_state


@pytest.mark.parametrize("case", list(CASES))
def test_master_weights_offloaded_train_bit_identically_to_the_mixed_precision_reference(case):
    cfg = CASES[case]
    ref_losses, ref_model, ref_opt = _reference(cfg)
    model, optimizer = build_model_and_optimizer(cfg)
    assert optimizer.tx is with_master_weights(make_optimizer(cfg))
    step = TrainStep(model, optimizer, LOSS, grad_accum=cfg.grad_accum)
    losses = [float(step(tokens)["loss"]) for tokens in _batches(cfg)]
    step.sync()

    assert losses == ref_losses
    assert step.traces == 1  # the parameters stay bfloat16 from step to step
    # The device holds bfloat16 parameters, the host the float32 master and the moments.
    params = nnx.state(model, nnx.Param)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(BF16)}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(params)} == {"device"}
    state = _master_of(optimizer)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state)} == {HOST_MEMORY_KIND}
    ref_params = _flat(nnx.state(ref_model, nnx.Param))
    ref_inner, ref_master = ref_opt.opt_state
    masters = _flat(nnx.state(state.master))
    assert masters.keys() == _flat(nnx.state(ref_master)).keys() == ref_params.keys()
    for path, want in _flat(nnx.state(ref_master)).items():
        assert masters[path].dtype == np.float32
        np.testing.assert_array_equal(masters[path], want, err_msg=path)
    for path, value in _flat(params).items():
        assert value.dtype == ref_params[path].dtype
        np.testing.assert_array_equal(value, ref_params[path], err_msg=path)
    # AdamW's moments and counts: those of the reference's inner state.
    moments = [np.asarray(x) for x in jax.tree.leaves(nnx.state(state.inner))]
    ref_moments = [np.asarray(x) for x in jax.tree.leaves(nnx.state(ref_inner[1]))]
    assert len(moments) == len(ref_moments)
    for a, b in zip(moments, ref_moments):
        np.testing.assert_array_equal(a, b)
    # Every gradient is bfloat16 (the GTP-sharded ones reduced in float32 first), none
    # float32: the device never holds a float32 gradient tree.
    grads = nnx.grad(LOSS)(model, _batches(cfg)[0])
    assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype(BF16)}
    # Training moved the master off its rounded value: bfloat16 parameters alone would
    # have lost these updates.
    assert any(not np.array_equal(m, _rounded(jnp.asarray(m))) for m in masters.values())


class _UserMLP(nnx.Module):
    """A user's own module: two plain (not layer-stacked) linears, one of a width that
    does not divide the 4-device GTP axis."""

    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(64, 90, rngs=rngs)
        self.down = nnx.Linear(90, 32, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x)))


def _user_loss(model: nnx.Module, x: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(model(x).astype(jnp.float32) - 0.5))


def test_a_users_module_trains_with_master_weights_like_the_reference():
    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    tx = make_optimizer(CFG)
    x = jax.device_put(np.random.default_rng(1).normal(size=(8, 64)).astype(np.float32),
                       gtp_jax.data_sharding(mesh))

    def run(master: bool) -> tuple[list[float], dict[str, np.ndarray]]:
        config = gtp_jax.GTPConfig(min_elements=64, offload_optimizer=master,
                                   offload_master_weights=master)
        model = gtp_jax.shard(_UserMLP(nnx.Rngs(0)), mesh, config)
        if master:
            optimizer = make_nnx_optimizer(model, tx, wrt=nnx.Param)
        else:
            optimizer = nnx.Optimizer(model, _reference_tx(tx), wrt=nnx.Param)
            hold_params_in(model, BF16)
        step = TrainStep(model, optimizer, _user_loss)
        losses = [float(step(x)["loss"]) for _ in range(3)]
        step.sync()
        return losses, _flat(nnx.state(model, nnx.Param))

    (ref_losses, ref_params), (losses, params) = run(False), run(True)
    assert losses == ref_losses and losses[-1] < losses[0]
    assert params.keys() == ref_params.keys()
    for path, value in params.items():
        assert value.dtype == jnp.dtype(BF16)
        np.testing.assert_array_equal(value, ref_params[path], err_msg=path)


def test_master_weights_halve_the_parameters_and_add_them_to_the_host():
    without = dataclasses.replace(CFG, offload_master_weights=False)
    bound, base = memory_bound(CFG), memory_bound(without)
    assert bound["params"] * 2 == base["params"]
    assert bound["grads"] * 2 == base["grads"]  # bfloat16 gradients
    assert pinned_host_bound(CFG) * 2 == pinned_host_bound(without) * 3
    # What the built state holds in host memory: the moments and the float32 parameters.
    model, optimizer = build_model_and_optimizer(CFG)
    state = nnx.state(optimizer, nnx.OptState)
    leaves = [v.get_value() for _, v in nnx.to_flat_state(state)]
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    host = host_bytes_per_device(abstract, [x.sharding for x in leaves])
    device_params = sum(x.addressable_shards[0].data.nbytes
                        for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    # Each device's bfloat16 shards are half its float32 shards; the host holds three
    # float32 arrays per parameter (master, two moments) and a few scalars.
    assert 6 * device_params <= host <= 6 * device_params + 64


def test_master_weights_are_refused_where_they_cannot_work():
    with pytest.raises(UsageError, match="offload_optimizer"):
        gtp_jax.GTPConfig(offload_master_weights=True)
    with pytest.raises(UsageError, match="offload_optimizer"):
        dataclasses.replace(CFG, offload_optimizer=False)
    # Weights loaded after the optimizer took its master would leave the master behind.
    with pytest.raises(UsageError, match="init_from"):
        dataclasses.replace(CFG, init_from="some/run")

    model, _ = build_model_and_optimizer(dataclasses.replace(CFG, offload_master_weights=False))
    mesh = next(iter(jax.tree.leaves(nnx.state(model, nnx.Param)))).sharding.mesh

    def master_model():
        from gtp_jax.models import Transformer
        from gtp_jax.train.config import gtp_config, model_config
        return gtp_jax.shard_init(
            lambda: Transformer(model_config(CFG), rngs=nnx.Rngs(0)), mesh, gtp_config(CFG))

    # An optimizer that cannot stream the master: refused before anything is cast.
    fresh = master_model()
    with pytest.raises(UsageError, match="streamable chain"):
        make_nnx_optimizer(fresh, optax.adamw(1e-3), wrt=nnx.Param)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(fresh, nnx.Param))} == {
        jnp.dtype(jnp.float32)}
    # A plain nnx.Optimizer would update the bfloat16 parameters themselves.
    with pytest.raises(UsageError, match="make_nnx_optimizer"):
        TrainStep(fresh, nnx.Optimizer(fresh, make_optimizer(CFG), wrt=nnx.Param), LOSS)
    # Nothing to keep a master of: parameters already in bfloat16.
    nnx.update(fresh, jax.tree.map(lambda x: x.astype(BF16), nnx.state(fresh, nnx.Param)))
    with pytest.raises(UsageError, match="float32 parameters"):
        make_nnx_optimizer(fresh, make_optimizer(CFG), wrt=nnx.Param)
    # A loop of one's own would add bfloat16 updates to bfloat16 parameters.
    model, optimizer = build_model_and_optimizer(CFG)
    grads = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
    with pytest.raises(UsageError, match="TrainStep"):
        optimizer.update(model, grads)
    # A second optimizer for a model whose parameters the first one holds in bfloat16.
    with pytest.raises(UsageError, match="optimizer built for it before"):
        make_nnx_optimizer(model, make_optimizer(CFG), wrt=nnx.Param)


def test_a_checkpoint_restores_only_into_the_same_master_weight_setting(tmp_path):
    model, optimizer = build_model_and_optimizer(CFG)
    step = TrainStep(model, optimizer, LOSS)
    step(_batches(CFG)[0])
    step.sync()
    saved = _flat(nnx.state((model, optimizer)))
    with Checkpointer(CheckpointConfig(str(tmp_path / "master"), async_save=False)) as ckpt:
        ckpt.save(1, model, optimizer)
        fresh = build_model_and_optimizer(CFG)
        ckpt.restore(*fresh)
        for path, value in _flat(nnx.state(fresh)).items():
            np.testing.assert_array_equal(value, saved[path], err_msg=path)
        # Without master weights the bfloat16 parameters would be read as the model and
        # the float32 master dropped: refused, naming the setting.
        other = build_model_and_optimizer(dataclasses.replace(CFG, offload_master_weights=False))
        before = _flat(nnx.state(other))
        with pytest.raises(UsageError, match="offload_master_weights"):
            ckpt.restore(*other)
        for path, value in _flat(nnx.state(other)).items():
            np.testing.assert_array_equal(value, before[path], err_msg=path)
        # The model alone, beside an optimizer that holds its master: the next step would
        # set the parameters from that (stale) master, undoing the restore. Refused.
        model_only, its_optimizer = build_model_and_optimizer(CFG)
        before = _flat(nnx.state((model_only, its_optimizer)))
        with pytest.raises(UsageError, match="restore it with its optimizer"):
            ckpt.restore(model_only)
        for path, value in _flat(nnx.state((model_only, its_optimizer))).items():
            np.testing.assert_array_equal(value, before[path], err_msg=path)
    # And the other way round.
    plain = build_model_and_optimizer(dataclasses.replace(CFG, offload_master_weights=False))
    with Checkpointer(CheckpointConfig(str(tmp_path / "plain"), async_save=False)) as ckpt:
        ckpt.save(1, *plain)
        with pytest.raises(UsageError, match="offload_master_weights"):
            ckpt.restore(*build_model_and_optimizer(CFG))


def test_cli_needs_optimizer_offload_for_master_weights(capsys):
    # In process: the refusals come before anything is built (a bug would raise here).
    for extra, needle in ((["--offload-master-weights"], "offload-optimizer"),
                          (["--offload-master-weights", "--offload-optimizer", "--plan",
                            "auto"], "--plan auto")):
        assert gtp_jax_main(["train", "--steps", "1", *extra]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err


def test_the_planner_compiles_the_master_weight_step_the_trainer_runs():
    # The planner's abstract state (its compiled memory figure) is the trained one: the
    # same program structure, bfloat16 parameters, float32 master in host memory.
    from gtp_jax.plan.memory import abstract_train_state

    graphdef, abstract, _ = abstract_train_state(CFG)
    model, optimizer = build_model_and_optimizer(CFG)
    step = TrainStep(model, optimizer, LOSS)
    assert graphdef == step.graphdef

    def described(state):
        return [(x.shape, jnp.dtype(x.dtype), x.sharding.memory_kind)
                for x in jax.tree.leaves(state)]

    trained = group_offloaded(step.graphdef, step.state, DEFAULT_GROUP_LAYERS)  # as step 1 does
    assert described(abstract) == described(trained)


def test_microbatch_gradients_of_bfloat16_parameters_are_summed_in_float32():
    # Each microbatch's bfloat16 gradient is added into a float32 sum and the mean is
    # rounded once: a bfloat16 sum would round at every add.
    from gtp_jax.train.step.train_step import accumulate_grads

    model = _UserMLP(nnx.Rngs(0))
    nnx.update(model, jax.tree.map(lambda p: p.astype(BF16), nnx.state(model, nnx.Param)))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(8, 64)), BF16)
    _, grads = accumulate_grads(model, _user_loss, x, 4)
    want = None
    for i in range(4):  # microbatch i takes rows i, i + 4 (accumulate_grads' split)
        g = nnx.grad(_user_loss)(model, x[i::4])
        g = jax.tree.map(lambda t: t.astype(jnp.float32), g)
        want = g if want is None else jax.tree.map(jnp.add, want, g)
    want = jax.tree.map(lambda t: (t * 0.25).astype(BF16), want)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        assert a.dtype == jnp.dtype(BF16)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_cast_from_sources_that_fails_part_way_says_the_model_must_be_built_again():
    # Every old value is released before the first cast (to keep device memory in one
    # piece); a cast that then fails (here a source already deleted, on a GPU running out
    # of memory) must say which variables were left empty, not leave a model that fails
    # later with unexplained shape errors.
    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    model = gtp_jax.shard(_UserMLP(nnx.Rngs(0)), mesh, gtp_jax.GTPConfig(min_elements=64))
    sources = [jnp.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    sources[1] = jnp.array(sources[1])
    sources[1].delete()
    with pytest.raises(RuntimeError, match=r"casting variable 2 of \d+ .* build it again"):
        hold_params_in(model, BF16, sources=sources)
