"""Context parallelism wired through the mesh, `ShardedModule` and the reference decoder.

The sequence is split over a ``cp`` mesh axis (ring attention, `gtp_jax.parallel.context`)
and composed with GTP, dp and tp (Megatron tensor/sequence parallelism inside a cp piece).
Every model case trains the same `Transformer` sharded and unsharded for `STEPS` AdamW
steps and compares the loss, the logits, every gradient (before each step) and every
parameter afterwards; sequence lengths that do not divide ``2 * cp`` exercise the padding
(``valid_len`` masking).

Tolerances (relative to max|reference| of each compared array): float32, `FP32_RTOL` =
1e-5 (as tests/test_tp.py). The sharded run computes the same float32 products per token
and sums them in a different order: attention per ring block merged by log-sum-exp (ring
attention alone is within ~3e-7 of dense attention, tests/test_ring_attention.py), weight
gradients as per-rank partial sums reduced over cp, gtp and dp. Through two layers, the LM
head and the cross-entropy that moves results by a few float32 ulps (observed <= 9.3e-7 over
all cases), 10x below the tolerance; a masking, position or reduction bug (a missing sum
over cp, a wrong rotary position, a leaked padding token) gives O(1) errors.
AdamW uses ``eps=1e-3`` so the update is Lipschitz in the gradient and parameters agree to
the same tolerance after several steps (as in tests/test_tp.py).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import (
    Mixed,
    assert_close,
    assert_matches_reference_steps,
    flat_values,
    mixed_tokens,
    mse_loss,
    path_str,
    sharded_logits_and_grads,
)
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gtp_jax
from gtp_jax.base.axes import current_axes
from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.base.mesh import AXES, AXES_CP, cp_size
from gtp_jax.models import Transformer, preset
from gtp_jax.sharding.contract import InputLayout, OutputLayout
from gtp_jax.sharding.module import unshard_values

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it

FP32_RTOL = 1e-5
STEPS = 3
LR = 1e-2
BATCH = 4

# head_dim 16, d_ff 48, vocab 29: no model dim equals a test sequence length (HLO check).
CFG = preset("tiny", d_model=32, n_heads=2, d_ff=48, vocab_size=29, n_layers=2,
             max_seq_len=64)


def adamw() -> optax.GradientTransformation:
    return optax.adamw(LR, eps=1e-3, weight_decay=1e-2)


def place_counters(opt: nnx.Optimizer, mesh) -> None:
    """optax step counters replicated on the mesh up front (one compile instead of two)."""
    rep = NamedSharding(mesh, P())
    for _, var in nnx.to_flat_state(nnx.state(opt)):
        value = var.get_value()
        if isinstance(value, jax.Array) and not isinstance(value.sharding, NamedSharding):
            var.set_value(jax.device_put(value, rep))


@nnx.jit
def lm_step(model: nnx.Module, opt: nnx.Optimizer, tokens: jax.Array):
    """One AdamW step on the next-token loss; returns loss, logits and the gradients."""

    def loss_fn(m):
        out = m(tokens[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(
            out.logits.astype(jnp.float32), tokens[:, 1:]).mean()
        return ce, out.logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    opt.update(model, grads)
    return loss, logits, grads


def _batches(cfg, seq: int, seed: int) -> list[jax.Array]:
    key = jax.random.key(seed)
    return [jax.random.randint(jax.random.fold_in(key, i), (BATCH, seq + 1), 0, cfg.vocab_size)
            for i in range(STEPS)]


def _reference_cfg(cfg):
    # cp_*, tp_overlap and remat do not change the unsharded math: share one reference run.
    return dataclasses.replace(cfg, cp_attention="ring", cp_layout="zigzag", remat="none",
                               tp_overlap=False)


@functools.cache
def _reference_run(cfg, seq: int, seed: int):
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    opt = nnx.Optimizer(model, adamw(), wrt=nnx.Param)
    steps = []
    for tokens in _batches(cfg, seq, seed):
        loss, logits, grads = lm_step(model, opt, tokens)
        steps.append((float(loss), np.asarray(logits),
                      {path_str(k): np.asarray(v) for k, v in flat_values(grads).items()}))
    final = {path_str(k): np.asarray(v) for k, v in flat_values(model).items()}
    return steps, final


def run_case(mesh_sizes: dict, cfg, seq: int, seed: int, prefetch: bool = False) -> None:
    mesh = gtp_jax.make_mesh(**mesh_sizes)
    ref_steps, ref_final = _reference_run(_reference_cfg(cfg), seq, seed)
    # prefetch cases run the scanned prefetching loop; the others the default (unrolled)
    cfg = dataclasses.replace(cfg, unroll_layers=not prefetch)
    sm = gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(seed)), mesh,
                       gtp_jax.GTPConfig(min_elements=0, prefetch=prefetch))
    opt = nnx.Optimizer(sm, adamw(), wrt=nnx.Param)
    place_counters(opt, mesh)
    results = [lm_step(sm, opt, jax.device_put(tokens, gtp_jax.data_sharding(mesh)))
               for tokens in _batches(cfg, seq, seed)]
    assert_matches_reference_steps(sm, results, ref_steps, ref_final, FP32_RTOL)


# --------------------------------------------------------------------------- mesh


@pytest.mark.parametrize("sizes", [{"cp": 8}, {"dp": 2, "cp": 4}, {"gtp": 2, "cp": 4},
                                   {"gtp": 4, "cp": 2}, {"gtp": 2, "cp": 2, "tp": 2}])
def test_make_mesh_cp_axis_order_and_groups(sizes) -> None:
    mesh = gtp_jax.make_mesh(**sizes)
    assert mesh.axis_names == AXES_CP == ("dp", "ep", "gtp", "cp", "tp")
    assert mesh.devices.shape == tuple(sizes.get(a, 1) for a in AXES_CP)
    assert mesh.axis_types == (AxisType.Auto,) * 5
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert ids.ravel().tolist() == [d.id for d in jax.devices()]
    cp, tp = sizes["cp"], sizes.get("tp", 1)
    groups = gtp_jax.describe_mesh(mesh)
    # cp inside gtp, outside tp: a cp ring is made of devices tp apart
    assert groups["cp"][0] == list(range(0, cp * tp, tp))
    assert gtp_jax.data_axes(mesh) == ("dp", "ep", "gtp")
    assert gtp_jax.seq_axes(mesh) == ("cp",) and cp_size(mesh) == cp
    assert gtp_jax.seq_sharding(mesh).spec == P(("dp", "ep", "gtp"), ("cp",))
    assert gtp_jax.data_sharding(mesh).spec == P(("dp", "ep", "gtp"), None)


def test_describe_mesh_dp2_cp4() -> None:
    mesh = gtp_jax.make_mesh(dp=2, cp=4)
    lines: list[str] = []
    groups = gtp_jax.describe_mesh(mesh, print_fn=lines.append)
    assert groups["cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lines[0] == "mesh (dp=2, ep=1, gtp=1, cp=4, tp=1) over 8 devices"
    assert any("cp groups: [[0, 1, 2, 3], [4, 5, 6, 7]]" in ln for ln in lines)


def test_cp1_mesh_is_the_four_axis_mesh() -> None:
    """cp=1 (the default) adds no axis: programs, checkpoints, describe output unchanged."""
    mesh = gtp_jax.make_mesh(dp=2, gtp=4, cp=1)
    assert mesh.axis_names == AXES == ("dp", "ep", "gtp", "tp")
    assert gtp_jax.seq_axes(mesh) == () and cp_size(mesh) == 1
    assert gtp_jax.seq_sharding(mesh).spec == P(("dp", "ep", "gtp"), None)


def test_make_mesh_cp_errors() -> None:
    with pytest.raises(UsageError, match=r"dp\*ep\*gtp\*cp\*tp = 1\*1\*1\*3\*1 = 3"):
        gtp_jax.make_mesh(cp=3)
    with pytest.raises(UsageError, match="cp=0"):
        gtp_jax.make_mesh(cp=0, gtp=8)
    with pytest.raises(UsageError, match="cp="):
        gtp_jax.make_mesh(cp=2.0, gtp=4)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_zigzag_to_contiguous_is_zigzag_merge(n) -> None:
    from jax.sharding import Mesh

    from gtp_jax.parallel.context import zigzag_split, zigzag_to_contiguous

    mesh = Mesh(np.array(jax.devices()[:n]), ("cp",))
    x = jnp.arange(2 * 2 * n * 3 * 5, dtype=jnp.float32).reshape(2, 2 * n * 3, 5)
    f = jax.shard_map(lambda v: zigzag_to_contiguous(v, "cp"), mesh=mesh,
                      in_specs=P(None, "cp"), out_specs=P(None, "cp"))
    np.testing.assert_array_equal(jax.jit(f)(zigzag_split(x, n)), x)
    # differentiable: the transpose is the inverse permutation
    g = jax.grad(lambda v: jnp.sum(f(v) * x))(zigzag_split(x, n))
    np.testing.assert_array_equal(g, zigzag_split(x, n))


# --------------------------------------------------------------------------- model equivalence

CASES = [
    # (mesh, config overrides, seq, prefetch)
    ({"cp": 8}, {}, 13, False),                                   # pad 13 -> 16
    ({"gtp": 4, "cp": 2}, {}, 13, True),                          # pad 13 -> 16, prefetch
    ({"gtp": 2, "cp": 4}, {"remat": "dots"}, 16, True),           # no padding, remat dots
    ({"dp": 2, "cp": 4}, {"remat": "full"}, 11, False),           # pad 11 -> 16, remat full
    ({"dp": 2, "gtp": 2, "cp": 2}, {"cp_layout": "contiguous"}, 13, True),  # 13 -> 14
    ({"gtp": 2, "cp": 4}, {"cp_attention": "allgather"}, 13, False),
    # cp x tp: Megatron tp/sp inside each cp piece (13 -> 16 = 2*cp*tp)
    ({"gtp": 2, "cp": 2, "tp": 2}, {}, 13, True),
    # 3 heads over tp=4 (padded heads), ring collective matmuls, contiguous layout
    ({"cp": 2, "tp": 4}, {"d_model": 48, "n_heads": 3, "d_ff": 64, "tp_overlap": True,
                          "cp_layout": "contiguous"}, 13, False),
]


@pytest.mark.parametrize("mesh_sizes,overrides,seq,prefetch", CASES, ids=[
    "cp8_pad", "gtp4_cp2_pad_prefetch", "gtp2_cp4_dots_prefetch", "dp2_cp4_pad_full",
    "dp2_gtp2_cp2_contiguous_prefetch", "gtp2_cp4_allgather", "gtp2_cp2_tp2_prefetch",
    "cp2_tp4_padded_heads_overlap_contiguous"])
def test_cp_matches_unsharded_over_steps(mesh_sizes, overrides, seq, prefetch) -> None:
    run_case(mesh_sizes, dataclasses.replace(CFG, **overrides), seq, 3, prefetch)




def test_zigzag_equals_contiguous() -> None:
    mesh = gtp_jax.make_mesh(gtp=2, cp=4)
    tokens = jax.random.randint(jax.random.key(1), (BATCH, 21), 0, CFG.vocab_size)
    z_logits, z_grads = sharded_logits_and_grads(CFG, mesh, tokens)
    c_logits, c_grads = sharded_logits_and_grads(
        dataclasses.replace(CFG, cp_layout="contiguous"), mesh, tokens)
    assert_close(z_logits, c_logits, FP32_RTOL, "logits")
    for path, g in z_grads.items():
        assert_close(g, c_grads[path], FP32_RTOL, f"grad {path}")


# --------------------------------------------------------------------------- wrapper contract


class SeqProbe(nnx.Module):
    """A user module that opts in to the sequence split: returns ``x @ w`` per token and
    records which axes it saw."""

    seen: list = []

    def __init__(self, rngs):
        self.lin = nnx.Linear(6, 5, rngs=rngs)

    def __call__(self, x):
        SeqProbe.seen.append(current_axes())
        return self.lin(x)

    def gtp_input_layout(self, mesh, x):
        return InputLayout()

    def gtp_output_layout(self, mesh, x):
        return OutputLayout(P(gtp_jax.data_axes(mesh), "cp"))


def test_opt_in_splits_dim1_over_cp_and_sums_weight_grads_over_cp(key) -> None:
    """An opted-in module gets [batch/data, seq/cp] pieces, sees cp in current_axes, and its
    replicated weights' gradients are summed over cp (shard_map's transpose) exactly as the
    unsharded gradient, not cp times it nor one rank's piece."""
    mesh = gtp_jax.make_mesh(dp=2, cp=4)
    ref = SeqProbe(nnx.Rngs(0))
    sm = gtp_jax.shard(ref, mesh, gtp_jax.GTPConfig(min_elements=10**9, include=("lin",)))
    x = jax.random.normal(key, (4, 8, 6))
    ct = jax.random.normal(jax.random.fold_in(key, 1), (4, 8, 5))
    loss = lambda m: jnp.sum(m(x) * ct)  # noqa: E731
    SeqProbe.seen = []
    got_loss, got = nnx.jit(nnx.value_and_grad(loss))(sm)
    axes = SeqProbe.seen[-1]
    assert axes.cp == "cp" and axes.cp_size == 4
    want_loss, want = nnx.jit(nnx.value_and_grad(loss))(ref)
    assert_close(got_loss, want_loss, 1e-6, "loss")
    got = unshard_values(sm, got)
    for k, v in flat_values(want).items():
        assert_close(got[path_str(k)], v, 1e-6, f"grad {path_str(k)}")


def test_module_without_opt_in_is_replicated_over_cp(key) -> None:
    """Any other module on a cp mesh: batch over the data axes only, cp ranks compute the
    same thing (not told about cp), gradients equal the unsharded ones."""
    mesh = gtp_jax.make_mesh(gtp=2, cp=4)
    ref = Mixed(nnx.Rngs(0))
    sm = gtp_jax.shard(ref, mesh, gtp_jax.GTPConfig(min_elements=0))
    tokens = mixed_tokens(key, batch=4, seq=6)
    got_loss, got = nnx.jit(nnx.value_and_grad(mse_loss))(sm, tokens)
    want_loss, want = nnx.jit(nnx.value_and_grad(mse_loss))(ref, tokens)
    assert_close(got_loss, want_loss, 1e-5, "loss")
    got = unshard_values(sm, got)
    for k, v in flat_values(want).items():
        assert_close(got[path_str(k)], v, 1e-5, f"grad {path_str(k)}")


class _Split(nnx.Module):
    def __init__(self, rngs, layout=None, out=True):
        self.lin = nnx.Linear(6, 5, rngs=rngs)
        self._layout, self._out = layout, out

    def __call__(self, x):
        return self.lin(x)

    def gtp_input_layout(self, mesh, x):
        return self._layout

    def gtp_output_layout(self, mesh, x):
        return OutputLayout(P(gtp_jax.data_axes(mesh), "cp")) if self._out else None


def test_usage_errors() -> None:
    mesh = gtp_jax.make_mesh(gtp=2, cp=4)
    cfg = gtp_jax.GTPConfig(min_elements=0)
    x = jnp.ones((2, 8, 6))

    def call(module, arg=x):
        return gtp_jax.shard(module, mesh, cfg)(arg)

    with pytest.raises(UsageError, match="does not divide over cp=4"):
        call(_Split(nnx.Rngs(0), InputLayout()), jnp.ones((2, 6, 6)))
    with pytest.raises(UsageTypeError, match="must return an InputLayout"):
        call(_Split(nnx.Rngs(0), "cp"))
    with pytest.raises(UsageError, match="define gtp_output_layout"):
        call(_Split(nnx.Rngs(0), InputLayout(), out=False))
    with pytest.raises(UsageError, match="split_seq"):
        call(_Split(nnx.Rngs(0), InputLayout(split_seq=("kwargs['mask']",))))
    # the Transformer: cp with experts is refused before anything runs
    tokens = jnp.zeros((2, 8), jnp.int32)
    moe = dataclasses.replace(CFG, moe_experts=2)
    with pytest.raises(UsageError, match="mixture of experts"):
        gtp_jax.shard(Transformer(moe, rngs=nnx.Rngs(0)), mesh, cfg)(tokens)
    with pytest.raises(ValueError, match="cp_attention"):
        preset("tiny", cp_attention="flash")
    with pytest.raises(ValueError, match="cp_layout"):
        preset("tiny", cp_layout="striped")


# --------------------------------------------------------------------------- program check


def _shapes(hlo: str) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in m.split(",") if x)
            for m in re.findall(r"\b(?:f32|bf16|f16|s32|pred)\[([0-9,]*)\]", hlo)]


def _step_hlo(cfg, mesh, seq: int) -> str:
    sm = gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(0)), mesh,
                       gtp_jax.GTPConfig(min_elements=0))
    tokens = jax.device_put(jnp.zeros((BATCH, seq + 1), jnp.int32), gtp_jax.data_sharding(mesh))
    graphdef, state = nnx.split(sm)

    def loss(state, tokens):
        out = nnx.merge(graphdef, state)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            out.logits.astype(jnp.float32), tokens[:, 1:]).mean()

    return jax.jit(jax.value_and_grad(loss)).lower(state, tokens).compile().as_text()


def test_cp_step_moves_kv_by_collective_permute_without_full_scores() -> None:
    """A cp=4 training step (forward + backward) sends K/V around the ring with
    collective-permute and never holds an [S, S] scores array (nor [S/cp, S]); the
    all-gather baseline does hold [S/cp, S] scores (positive control of the parser)."""
    mesh = gtp_jax.make_mesh(gtp=2, cp=4)
    seq = 40  # no model dim is 40 or 10
    el = seq // 4
    hlo = _step_hlo(CFG, mesh, seq)
    # K/V blocks [local batch, S/cp, heads, head_dim] travel by collective-permute, K and V
    # as one flat buffer (the logits' zigzag reorder permutes [.., S/2cp, vocab] halves,
    # which do not match this)
    kv = f"[{2 * (BATCH // 2) * el * CFG.n_heads * CFG.head_size}]"
    permutes = [ln for ln in hlo.splitlines() if "collective-permute(" in ln]
    assert any(kv in ln for ln in permutes), f"no K/V {kv} collective-permute"
    shapes = _shapes(hlo)
    assert shapes
    assert not [s for s in shapes if s.count(seq) >= 2], "[S, S] array in the cp step"
    assert not [s for s in shapes if len(s) >= 2 and s[-2:] in ((el, seq), (seq, el))]
    # the logits go back to natural order by ppermute: no rank holds [S, vocab] logits
    assert not [s for s in shapes if len(s) >= 2 and s[-2:] == (seq, CFG.vocab_size)]
    ag = _step_hlo(dataclasses.replace(CFG, cp_attention="allgather"), mesh, seq)
    assert any(s[-2:] == (el, seq) for s in _shapes(ag) if len(s) >= 2)


def test_cli_trains_with_cp_like_without(tmp_path, capsys) -> None:
    # `--cp 2` splits each sequence over 2 devices; the math is the model's, so the first
    # losses equal a run without cp up to float32 summation order. In process (docs/cli.md's
    # `--cp 2` example runs the command line as a process).
    import json

    from gtp_jax.train.cli.command import main as cli_main

    losses = {}
    for name, flags in (("cp", ["--cp", "2"]), ("plain", [])):
        out = tmp_path / f"{name}.json"
        assert cli_main(["train", "--steps", "2", "--seq", "64", "--batch", "8", "--layers", "2",
                         "--metrics-json", str(out), *flags]) == 0
        stdout = capsys.readouterr().out
        losses[name] = [s["loss"] for s in json.loads(out.read_text())["steps"]]
        assert ("cp=2" in stdout) == (name == "cp"), stdout[:300]
    np.testing.assert_allclose(losses["cp"], losses["plain"], rtol=1e-5)
