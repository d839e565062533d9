"""The unrolled layer loop (``scan_layers(unroll=True)``) against the scanned one."""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import assert_same_runs, get_mesh, train_and_record

import gtp_jax
from gtp_jax.models import Transformer, lm_loss, preset

# Odd sizes that do not divide the 4-way gtp axis; two layers (the unrolled program, and
# its compile time, grow with each).
CFG = preset("tiny", d_model=96, n_heads=4, d_ff=200, vocab_size=250, n_layers=2)


def _train(tokens: list[jax.Array], seed: int, *, unroll: bool, remat: str = "none",
           sharded: bool = True, keep: bool = False):
    cfg = preset("tiny", **{**CFG.__dict__, "remat": remat, "unroll_layers": unroll})
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    if not sharded:
        return train_and_record(model, tokens)
    mesh = get_mesh("dp2_gtp4")
    model = gtp_jax.shard(model, mesh, gtp_jax.GTPConfig(keep_gathered_layers=keep))
    return train_and_record(model, tokens, mesh)


def _tokens(key: jax.Array) -> list[jax.Array]:
    return [jax.random.randint(jax.random.fold_in(key, i), (8, 17), 0, CFG.vocab_size)
            for i in range(3)]


@pytest.mark.parametrize(("remat", "sharded", "keep"),
                         [("none", True, False), ("dots", True, True), ("dots", False, False)])
def test_unrolled_loop_matches_scanned_loop_over_steps(key, seed, remat, sharded, keep):
    tokens = _tokens(key)
    assert_same_runs(_train(tokens, seed, unroll=False, remat=remat, sharded=sharded),
                      _train(tokens, seed, unroll=True, remat=remat, sharded=sharded,
                             keep=keep))


@pytest.mark.parametrize("sharded", [False, True])
def test_unrolled_gradient_program_has_no_loop(sharded):
    # The point of unrolling: no while loop, so no residual stacks to copy into and out of.
    mesh = get_mesh("gtp8")

    def program(unroll: bool) -> str:
        model = Transformer(preset("tiny", **{**CFG.__dict__, "unroll_layers": unroll,
                                              "remat": "dots"}), rngs=nnx.Rngs(0))
        tokens = np.zeros((8, 16), np.int32)
        if sharded:
            model = gtp_jax.shard(model, mesh)
            tokens = jax.device_put(tokens, gtp_jax.data_sharding(mesh))
        graphdef, state = nnx.split(model)
        grad = jax.jit(jax.grad(lambda s: lm_loss(nnx.merge(graphdef, s), tokens)))
        # The program as JAX hands it to XLA: the CPU backend's loop emitters add loops of
        # their own when compiling (e.g. for dynamic-update-slices).
        return grad.lower(state).as_text()

    assert re.search(r"\bstablehlo\.while\b", program(False))
    assert not re.search(r"\bstablehlo\.while\b", program(True))


@pytest.mark.parametrize("grad", [False, True])
def test_unrolled_gathers_are_tied_one_layer_ahead(grad):
    # Each gather (and, backward, each gradient reduce-scatter) is held back by an
    # optimization barrier until the layer before it has its input: without them XLA's
    # scheduler may issue every layer's gather at once and keep all of them alive.
    mesh = get_mesh("gtp8")
    n = CFG.n_layers
    model = gtp_jax.shard(Transformer(preset("tiny", **{**CFG.__dict__, "unroll_layers": True}),
                                      rngs=nnx.Rngs(0)), mesh)
    graphdef, state = nnx.split(model)
    tokens = jax.device_put(np.zeros((8, 16), np.int32), gtp_jax.data_sharding(mesh))

    def loss(s):
        return lm_loss(nnx.merge(graphdef, s), tokens)

    text = jax.jit(jax.grad(loss) if grad else loss).lower(state).as_text()
    barriers = text.count("stablehlo.optimization_barrier")
    # forward: one per layer after the first; backward: one gather per layer but the last
    # and one reduce-scatter per layer but the first (the forward's are in the grad too)
    assert barriers >= (3 * (n - 1) if grad else n - 1), barriers


def test_each_layer_is_linearized_once_not_once_per_layer(monkeypatch):
    # The unrolled loop linearizes the layer (jax.vjp: JVP plus partial evaluation, most of
    # a layer's trace time) once per argument type and evaluates that jaxpr for every
    # layer: tracing a deep unrolled model costs one layer's linearization, not one per
    # layer (a 32-layer tiny decoder's gradient: 2.2 -> 1.6 s to trace on a CPU).
    from gtp_jax.sharding import loop

    calls = []
    vjp = jax.vjp

    def counting(fn, *args, **kwargs):
        if isinstance(fn, functools.partial) and fn.func is loop._call_converted:
            calls.append(fn)
        return vjp(fn, *args, **kwargs)

    monkeypatch.setattr(jax, "vjp", counting)
    mesh = get_mesh("gtp8")
    cfg = preset("tiny", **{**CFG.__dict__, "unroll_layers": True, "n_layers": 5})
    model = gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
    graphdef, state = nnx.split(model)
    tokens = jax.device_put(np.zeros((8, 16), np.int32), gtp_jax.data_sharding(mesh))
    grads = jax.jit(jax.grad(lambda s: lm_loss(nnx.merge(graphdef, s), tokens)))
    grads.trace(state)
    assert len(calls) == 1, len(calls)


def test_prefetch_does_not_change_the_unrolled_program():
    # The unrolled loop always gathers one layer ahead; GTPConfig.prefetch (the scanned
    # loop's schedule) leaves its program as it is, which is what the CLI's header says.
    mesh = get_mesh("gtp8")
    tokens = jax.device_put(np.zeros((8, 16), np.int32), gtp_jax.data_sharding(mesh))

    def program(prefetch: bool) -> str:
        model = gtp_jax.shard(
            Transformer(preset("tiny", **{**CFG.__dict__, "unroll_layers": True}),
                        rngs=nnx.Rngs(0)), mesh, gtp_jax.GTPConfig(prefetch=prefetch))
        graphdef, state = nnx.split(model)
        return jax.jit(jax.grad(lambda s: lm_loss(nnx.merge(graphdef, s), tokens))
                       ).lower(state).as_text()

    assert program(True) == program(False)


def test_unroll_layers_must_be_a_bool_or_none():
    with pytest.raises(TypeError, match="unroll_layers=1 must be True, False or None"):
        preset("tiny", unroll_layers=1)


@pytest.mark.parametrize(("unroll", "remat", "want"), [
    (None, "none", True), (None, "dots", True), (None, "full", False),
    (True, "full", True), (False, "dots", False)])
def test_default_unrolls_unless_remat_full(unroll, remat, want):
    assert preset("tiny", unroll_layers=unroll, remat=remat).unrolled is want


def test_partial_unroll_is_refused():
    params = {"w": jax.numpy.ones((3, 4))}
    with pytest.raises(TypeError, match="unroll=2 must be True or False"):
        gtp_jax.scan_layers(lambda h, p: h * p["w"], jax.numpy.ones(4), params, unroll=2)


@pytest.mark.parametrize("axes,config", [
    ({"dp": 2, "gtp": 2, "tp": 2}, {"gather_format": "fp8"}),  # TP/SP + fp8 gathers
    ({"gtp": 2, "cp": 2, "tp": 2}, {"prefetch": True}),        # context parallel ring
], ids=["dp2_gtp2_tp2_fp8", "gtp2_cp2_tp2_prefetch"])
def test_unrolled_loop_composes_like_the_scanned_one(key, seed, axes, config):
    # The unrolled schedule runs the same layer function, gathers and reduce-scatters as the
    # scanned one (plain or prefetch), so with TP, context parallelism or low-precision
    # gathers it must give the scanned loop's results (fp32; the quantized weights are the
    # same bytes in both).
    mesh = gtp_jax.make_mesh(**axes)
    tokens = _tokens(key)[:2]

    def run(unroll: bool):
        cfg = preset("tiny", **{**CFG.__dict__, "unroll_layers": unroll, "remat": "dots"})
        model = gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(seed)), mesh,
                              gtp_jax.GTPConfig(**config))
        return train_and_record(model, tokens, mesh)

    assert_same_runs(run(False), run(True))
