"""Prefetch (double-buffered layer loop) vs the plain GTP loop, and its compiled structure."""

from __future__ import annotations

import math
import re

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import assert_same_runs, get_mesh, max_rel_err, train_and_record

import gtp_jax
from gtp_jax.models import Transformer, lm_loss, preset

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it

# Small odd sizes: 3 layers (peeled first and last + one scanned), dims that do not divide 4.
# The scanned loop (unroll_layers=False): these tests are about its schedules.
CFG = preset("tiny", d_model=96, n_heads=4, d_ff=200, vocab_size=250, n_layers=3,
             unroll_layers=False)


def _train(prefetch: bool, tokens: list[jax.Array], seed: int, remat: str = "none",
           n_layers: int = 3, keep: bool = False):
    mesh = get_mesh("dp2_gtp4")
    cfg = preset("tiny", **{**CFG.__dict__, "remat": remat, "n_layers": n_layers})
    model = gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(seed)), mesh,
                          gtp_jax.GTPConfig(prefetch=prefetch, keep_gathered_layers=keep))
    return train_and_record(model, tokens, mesh)


# 3 layers: peeled first and last + one scanned layer in each direction; 2 layers: no
# scanned backward layer at all (the loop's other branch).
@pytest.mark.parametrize(("remat", "n_layers"), [("none", 3), ("dots", 2)])
def test_prefetch_matches_plain_loop_over_steps(key, seed, remat, n_layers):
    # Same math, different schedule: fp32 results agree to rounding (reduction order only).
    tokens = _tokens(key)
    assert_same_runs(_train(False, tokens, seed, remat, n_layers),
                      _train(True, tokens, seed, remat, n_layers))


def _tokens(key: jax.Array) -> list[jax.Array]:
    return [jax.random.randint(jax.random.fold_in(key, i), (8, 17), 0, CFG.vocab_size)
            for i in range(3)]


def _loop_carry_shapes(hlo: str) -> list[str]:
    """Shapes in the tuple types of every ``while`` op of an HLO module text."""
    shapes = []
    for line in hlo.splitlines():
        if re.search(r"\bwhile\(", line):
            head = line.split("while(")[0]
            shapes += re.findall(r"f32\[[0-9,]*\]", head)
    return shapes


def _compiled_forward(prefetch: bool, mesh_name: str = "gtp8") -> str:
    mesh = get_mesh(mesh_name)
    model = gtp_jax.shard(Transformer(CFG, rngs=nnx.Rngs(0)), mesh,
                          gtp_jax.GTPConfig(prefetch=prefetch))
    graphdef, state = nnx.split(model)
    tokens = jax.device_put(np.zeros((8, 16), np.int32), gtp_jax.data_sharding(mesh))
    fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    return fwd.lower(state, tokens).compile().as_text()


@pytest.mark.parametrize(("prefetch", "remat", "n_layers"),
                         [(False, "none", 3), (True, "dots", 3)])
def test_kept_gathered_weights_equal_regathered_ones(key, seed, prefetch, remat, n_layers):
    # keep_gathered_layers keeps each layer's gathered weights for the backward pass instead
    # of gathering them again: the same values, so the same fp32 results up to rounding.
    tokens = _tokens(key)
    assert_same_runs(_train(prefetch, tokens, seed, remat, n_layers),
                      _train(prefetch, tokens, seed, remat, n_layers, keep=True))


@pytest.mark.parametrize("prefetch,coalesce", [(False, True), (True, True), (False, False)],
                         ids=["unrolled", "prefetch", "unrolled_per_weight"])
def test_kept_gathered_weights_leave_the_backward_pass_without_gathers(prefetch, coalesce):
    mesh = get_mesh("dp2_gtp4")
    tokens = jax.device_put(jax.numpy.zeros((8, 17), jax.numpy.int32),
                            gtp_jax.data_sharding(mesh))

    def gathers(keep: bool, grad: bool) -> int:
        model = gtp_jax.shard(Transformer(CFG, rngs=nnx.Rngs(0)), mesh,
                              gtp_jax.GTPConfig(prefetch=prefetch, keep_gathered_layers=keep,
                                                remat_gathered=not keep,
                                                coalesce_layer_collectives=coalesce))
        graphdef, state = nnx.split(model)

        def loss(state):
            return lm_loss(nnx.merge(graphdef, state), tokens)

        text = jax.jit(jax.grad(loss) if grad else loss).lower(state).as_text()
        # gathers of weights (a weight's padded shape; one per layer: all of its weights'
        # shards as one [gtp, total] buffer), not of activations or token ids (the
        # vocabulary-parallel embedding and head gather those)
        weights = {"x".join(map(str, p.spec.padded_shape)) for p in model.plan}
        stacked = [p.spec for p in model.plan if p.stacked]
        weights.add(f"{stacked[0].axis_size}x{sum(math.prod(s.shard_shape) for s in stacked)}")
        results = re.findall(r"stablehlo\.all_gather.*?-> tensor<([\dx]+)x\w+>", text)
        return sum(r in weights for r in results)

    forward = gathers(True, grad=False)
    assert gathers(False, grad=False) == forward
    # the gradient program gathers only what the forward pass does when the weights are
    # kept (the layer stack's; the embedding and head are read as vocabulary slices, never
    # gathered), and the stacked layers' weights once more (in the backward loop) otherwise
    assert forward > 0
    assert gathers(True, grad=True) == forward
    assert gathers(False, grad=True) >= forward + (1 if coalesce else 4)


def test_prefetch_loop_carries_next_layers_gathered_weights():
    # Double buffer: the forward loop's carry holds one layer's *gathered* (full, logical)
    # weights, gathered one iteration ahead; the plain loop carries none.
    full = {"f32[96,3,4,24]", "f32[4,24,96]", "f32[96,400]", "f32[200,96]"}
    pre = _loop_carry_shapes(_compiled_forward(True))
    plain = _loop_carry_shapes(_compiled_forward(False))
    assert full <= set(pre), pre
    assert not full & set(plain), plain
    # At most one gathered copy of each weight rides in the carry (two alive with the
    # one being used): bounded, not one per layer.
    for shape in full:
        assert pre.count(shape) == 1, (shape, pre)


def test_prefetch_at_gtp1_carries_no_second_copy_of_the_weights():
    # Nothing is gathered at gtp=1: the double buffer would only hold the next layer's
    # weights a second time (llama3-8b's scanned loop ran out of memory on one GPU for it).
    full = {"f32[96,3,4,24]", "f32[4,24,96]", "f32[96,400]", "f32[200,96]"}
    assert not full & set(_loop_carry_shapes(_compiled_forward(True, "dp8_gtp1")))


def _downstream(body: str, op: str) -> tuple[set[str], dict[str, str]]:
    """The instructions of HLO computation `body` that use, directly or not, the result of
    any `op` instruction (e.g. ``all-gather``), and every instruction's text by name."""
    lines = {}
    for line in body.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.-]+) = (.*)", line)
        if m:
            lines[m.group(1)] = m.group(2)
    users: dict[str, list[str]] = {}
    for name, rest in lines.items():
        for operand in re.findall(r"%([\w.-]+)", rest.split("(", 1)[-1]):
            users.setdefault(operand, []).append(name)
    todo = [n for n, rest in lines.items() if re.search(rf"\s{op}(?:-start)?\(", rest)]
    seen: set[str] = set()
    while todo:
        for user in users.get(todo.pop(), []):
            if user not in seen:
                seen.add(user)
                todo.append(user)
    return seen, lines


def _gather_bodies(text: str) -> tuple[list[str], dict[str, str]]:
    """The computations of compiled HLO `text` other than the entry that hold an all-gather
    and a matmul (their own ``dot`` or one in a fusion they call), and all by name."""
    computations = {c.split(" ", 1)[0].lstrip("%"): c for c in re.split(r"\n(?=\S)", text)}

    def has_dot(comp: str) -> bool:
        return " dot(" in comp or any(
            " dot(" in computations.get(name, "")
            for name in re.findall(r"calls=%?([\w.-]+)", comp))

    return [c for c in computations.values() if " all-gather" in c and has_dot(c)
            and not c.startswith("ENTRY")], computations


def _reads_dot(reached: set[str], lines: dict[str, str], computations: dict[str, str]) -> bool:
    """Whether any of the instructions `reached` is a matmul or a fusion computing one."""
    for name in reached:
        rest = lines[name]
        called = re.search(r"calls=%?([\w.-]+)", rest)
        if " dot(" in f" {rest}" or (called and " dot(" in computations.get(called.group(1), "")):
            return True
    return False


def test_prefetch_gathers_next_layer_before_current_dot():
    # In the compiled loop body the all-gather fetches the next layer: its result reaches
    # the loop's carry (the ROOT tuple) and no matmul of this iteration, so a scheduler is
    # free to run it beside them (a structural check: where a CPU scheduler puts it is the
    # scheduler's choice).
    bodies, computations = _gather_bodies(_compiled_forward(True))
    assert bodies, "no loop body with both an all-gather and a matmul"
    for body in bodies:
        reached, lines = _downstream(body, "all-gather")
        root = next(n for n in lines if re.search(rf"ROOT\s+%?{re.escape(n)} =", body))
        assert root in reached, "the gathered weight does not reach the loop carry"
        assert not _reads_dot(reached, lines, computations), \
            "a matmul of this iteration reads the weight gathered for the next"
    # The contrast: without prefetch the body's gather feeds this iteration's matmuls.
    bodies, computations = _gather_bodies(_compiled_forward(False))
    assert bodies and all(_reads_dot(*_downstream(b, "all-gather"), computations)
                          for b in bodies)


def _odd_layer_program(prefetch: bool, n_layers: int = 4):
    """Loss and grads of a loop whose layer transposes, rescales and casts its gathered
    weights before use (what an arbitrary user layer may do)."""
    mesh = get_mesh("gtp8")
    spec = gtp_jax.sharding.GatherSpec(axis="gtp", axis_size=8, shard_dim=0, logical_shape=(24, 16),
                              padded_size=24, param_dtype=np.dtype("float32"),
                              gather_dtype=None, reduce_dtype=np.dtype("float32"))
    P = jax.sharding.PartitionSpec

    def layer(h, w):
        h1 = h @ w["a"].T                                   # [b, 24] from a transpose
        w2 = (w["b"] * 1.0).astype(jax.numpy.float32)       # a new array, same values
        return jax.numpy.tanh(h1) @ w2 + 0.1 * h

    def local_loss(h, a, b):
        params = {"a": gtp_jax.GTPShard(a, spec), "b": gtp_jax.GTPShard(b, spec)}
        out = gtp_jax.scan_layers(layer, h, params, prefetch=prefetch)
        return jax.lax.psum(jax.numpy.sum(out ** 2), "gtp")

    loss = jax.shard_map(local_loss, mesh=mesh, out_specs=P(),
                         in_specs=(P("gtp"), P(None, "gtp"), P(None, "gtp")), check_vma=False)

    def reference(h, a, b):
        def body(c, w):
            return layer(c, {"a": w[0], "b": w[1]}), None
        return jax.numpy.sum(jax.lax.scan(body, h, (a, b))[0] ** 2)

    keys = jax.random.split(jax.random.key(3), 3)
    h = jax.random.normal(keys[0], (16, 16))
    a = 0.2 * jax.random.normal(keys[1], (n_layers, 24, 16))
    b = 0.2 * jax.random.normal(keys[2], (n_layers, 24, 16))
    return loss, reference, (h, a, b)


@pytest.mark.parametrize("prefetch", [False, True])
def test_loop_saves_no_weight_derived_residual(prefetch):
    # Whatever the layer does to its gathered weights (transpose, rescale, cast), nothing
    # computed from the weights alone is stacked as a residual: the backward recomputes it
    # from the re-gathered weights. Stacked residuals of a [24, 16] weight would show up as
    # [layers, 24, 16] or [layers, 16, 24] buffers in the compiled gradient program.
    loss, reference, args = _odd_layer_program(prefetch)
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    hlo = grad.lower(*args).compile().as_text()
    assert not re.findall(r"f32\[[23],(24,16|16,24)\]", hlo)
    (value, grads), (ref_value, ref_grads) = grad(*args), jax.value_and_grad(
        reference, argnums=(0, 1, 2))(*args)
    assert abs(float(value) - float(ref_value)) <= 1e-5 * abs(float(ref_value))
    for g, r in zip(grads, ref_grads):
        assert max_rel_err(np.asarray(g), np.asarray(r)) < 1e-5


@pytest.mark.parametrize(("prefetch", "gather_format"), [(False, None), (True, None),
                                                          (True, "fp8")])
def test_layer_stack_on_one_device(prefetch, gather_format, key, seed):
    # One device runs without shard_map: the layer loop must gather and reduce-scatter over
    # a 1-wide axis without binding it, and give the unsharded model's loss and gradients
    # (fp8 against the unsharded model on quantize-dequantized weights is covered elsewhere;
    # here only that it runs and stays finite).
    mesh = gtp_jax.make_mesh(gtp=1, devices=jax.devices()[:1])
    ref = Transformer(CFG, rngs=nnx.Rngs(seed))
    sm = gtp_jax.shard(ref, mesh, gtp_jax.GTPConfig(prefetch=prefetch, gather_format=gather_format,
                                                    quant_backend="reference"))
    tokens = jax.random.randint(key, (4, 17), 0, CFG.vocab_size)
    loss_sm, g_sm = nnx.jit(nnx.value_and_grad(lm_loss))(sm, tokens)
    assert np.isfinite(float(loss_sm))
    if gather_format is None:
        loss_ref, g_ref = nnx.jit(nnx.value_and_grad(lm_loss))(ref, tokens)
        assert abs(float(loss_sm) - float(loss_ref)) <= 1e-5 * abs(float(loss_ref))
        ref_flat = dict(nnx.to_flat_state(nnx.state(g_ref, nnx.Param)))
        for path, g in nnx.to_flat_state(nnx.state(g_sm, nnx.Param)):
            want = ref_flat[path[1:]].get_value()
            assert max_rel_err(np.asarray(g.get_value())[tuple(slice(0, n) for n in want.shape)],
                               np.asarray(want)) < 1e-5, path


@pytest.mark.parametrize("prefetch", [False, True])
def test_loop_stacks_start_uninitialized(prefetch):
    # Every slot of the residual and gradient stacks is written, so the loop allocates them
    # with lax.empty (uninitialized memory on GPU) rather than zero-filling them first.
    mesh = get_mesh("gtp8")
    model = gtp_jax.shard(Transformer(CFG, rngs=nnx.Rngs(0)), mesh,
                          gtp_jax.GTPConfig(prefetch=prefetch))
    graphdef, state = nnx.split(model)
    tokens = jax.numpy.zeros((8, 17), jax.numpy.int32)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda s: lm_loss(nnx.merge(graphdef, s), tokens)))(
        state))
    stacks = re.findall(r"= empty\[[^\]]*shape=\((\d+),", jaxpr)
    # a gradient stack per GTP-sharded weight (qkv, out, gate_up, down) and residual stacks
    assert stacks.count(str(CFG.n_layers)) + stacks.count(str(CFG.n_layers - 1)) >= 4, stacks
