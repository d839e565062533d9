"""Megatron tensor + sequence parallelism composed with GTP (and dp) matches the unsharded model.

Every case trains the same model sharded and unsharded for `STEPS` AdamW steps and compares
the loss, the logits, every gradient (before each step) and every parameter afterwards.
The cases cover tp=2 and tp=4, tp x gtp, dp x gtp x tp, ring overlap on, off and per
projection, sequence lengths that do and do not divide tp (17 is padded to 18 / 20), and
head counts that do and do not divide tp (3 heads: one padded head on tp=2, and on tp=4 a
rank that holds only a padded head).

Tolerances (relative to max|reference| of each compared array): float32, `FP32_RTOL`. The
sharded run does the same products per token; it sums them in a different order (split
contractions of the row-parallel GEMMs, per-rank partial weight gradients summed over tp,
gtp and dp), which moves results by a few float32 ulps. AdamW uses ``eps=1e-3`` so that
the update is Lipschitz in the gradient and parameters also agree to float32 tolerance
after several steps (see tests/test_equivalence.py); a wrong or missing update would show as
an O(lr) error.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_matches_reference_steps, flat_values, path_str
from jax.sharding import PartitionSpec as P

import gtp_jax
from gtp_jax.models import Transformer, preset
from gtp_jax.sharding.plan import ParamPlan, SplitPlan
from gtp_jax.train import replicate_stray_leaves

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it

FP32_RTOL = 1e-5
STEPS = 3
LR = 1e-2
BATCH = 8

# 3 heads of width 16: padded to 4 heads on tp=2 and tp=4. Untied LM head.
ODD = preset("tiny", d_model=48, n_heads=3, d_ff=64, vocab_size=61, n_layers=2)
# 4 heads divide tp=2 and tp=4. Tied embeddings (the LM head is embed.attend).
EVEN = preset("tiny", d_model=64, n_heads=4, d_ff=64, vocab_size=61, n_layers=2,
              tie_embeddings=True)


def adamw() -> optax.GradientTransformation:
    return optax.adamw(LR, eps=1e-3, weight_decay=1e-2)


def make_optimizer(model: nnx.Module, mesh=None) -> nnx.Optimizer:
    """AdamW over the params; scalar step counters placed on the mesh up front so the second
    step hits the jit cache instead of recompiling (no effect on values)."""
    opt = nnx.Optimizer(model, adamw(), wrt=nnx.Param)
    if mesh is not None:
        replicate_stray_leaves(opt, mesh)
    return opt


@nnx.jit
def lm_step(model: nnx.Module, opt: nnx.Optimizer, tokens: jax.Array):
    """One AdamW step on `lm_loss`; returns loss, logits and the gradients before the step."""
    cfg = getattr(model, "cfg", None) or model.module.cfg

    def loss_fn(m):
        out = m(tokens[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(
            out.logits.astype(jnp.float32), tokens[:, 1:]).mean()
        return ce + cfg.moe_aux_weight * out.aux.mean(), out.logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    opt.update(model, grads)
    return loss, logits, grads


@functools.cache
def _reference_run(cfg, seq: int, seed: int):
    """The unsharded model's per-step (loss, logits, grads) and final params (cached: several
    sharded cases share one reference)."""
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    init = flat_values(model)
    opt = make_optimizer(model)
    steps = []
    for tokens in _batches(cfg, seq, seed):
        loss, logits, grads = lm_step(model, opt, tokens)
        steps.append((float(loss), np.asarray(logits),
                      {path_str(k): np.asarray(v) for k, v in flat_values(grads).items()}))
    final = {path_str(k): np.asarray(v) for k, v in flat_values(model).items()}
    return init, steps, final


def _batches(cfg, seq: int, seed: int) -> list[jax.Array]:
    key = jax.random.key(seed)
    return [jax.random.randint(jax.random.fold_in(key, i), (BATCH, seq + 1), 0, cfg.vocab_size)
            for i in range(STEPS)]


def padding_mask(plan: ParamPlan | SplitPlan, logical_shape: tuple[int, ...]) -> np.ndarray:
    """True where the stored array holds a real entry, False where it holds padding."""
    return np.asarray(plan.to_stored(jnp.ones(logical_shape, jnp.float32))) != 0


def assert_padding_zero(sm: gtp_jax.ShardedModule, reference_params: dict) -> int:
    """Every padding entry (tp heads, gtp rows) of every stored param is exactly zero.

    Returns the number of padding entries checked (so a test can require that some exist).
    """
    stored = {path_str(k[1:]): np.asarray(v) for k, v in flat_values(sm).items()}
    count = 0
    for path, plan in sm.placements().items():
        mask = padding_mask(plan, reference_params[path].shape)
        assert mask.shape == stored[path].shape, path
        pad = stored[path][~mask]
        count += pad.size
        assert not np.any(pad), f"{path}: padding moved (max |pad| {np.max(np.abs(pad))})"
    return count


def run_case(mesh_sizes: dict, cfg, seq: int, seed: int, gtp_config=None) -> int:
    """Trains sharded vs unsharded for `STEPS` steps and compares everything; returns the
    number of padding entries found in the stored params (all asserted zero)."""
    mesh = gtp_jax.make_mesh(**mesh_sizes)
    ref = Transformer(cfg, rngs=nnx.Rngs(seed))
    sm = gtp_jax.shard(ref, mesh, gtp_config or gtp_jax.GTPConfig(min_elements=0))
    # tp_overlap does not change the unsharded math; dropping it lets cases share a compile.
    init, ref_steps, ref_final = _reference_run(dataclasses.replace(cfg, tp_overlap=False),
                                                seq, seed)
    # unshard() of the freshly sharded model gives back the exact unsharded weights.
    full = {path_str(k): np.asarray(v) for k, v in flat_values(gtp_jax.unshard(sm)).items()}
    chex.assert_trees_all_equal(full, {path_str(k): np.asarray(v) for k, v in init.items()})

    opt = make_optimizer(sm, mesh)
    results = [lm_step(sm, opt, jax.device_put(tokens, gtp_jax.data_sharding(mesh)))
               for tokens in _batches(cfg, seq, seed)]
    assert_matches_reference_steps(sm, results, ref_steps, ref_final, FP32_RTOL)
    return assert_padding_zero(sm, ref_final)


TP_CASES = [
    # (mesh, model, seq, overlap): tp=2 with gtp, padded heads and sequence, plain.
    ({"gtp": 4, "tp": 2}, ODD, 17, False),
    # tp=4 x dp, everything divides, ring overlap everywhere, tied embeddings.
    ({"dp": 2, "tp": 4}, EVEN, 16, True),
    # dp x gtp x tp, padded heads and sequence, ring overlap.
    ({"dp": 2, "gtp": 2, "tp": 2}, ODD, 17, True),
    # tp=4 x gtp: 3 heads over 4 ranks (rank 3 holds only padding), overlap on two projections.
    ({"gtp": 2, "tp": 4}, ODD, 17, ("qkv", "down")),
]


@pytest.mark.parametrize("mesh_sizes,cfg,seq,overlap", TP_CASES,
                         ids=["gtp4_tp2", "dp2_tp4_overlap", "dp2_gtp2_tp2_overlap",
                              "gtp2_tp4_overlap_qkv_down"])
def test_tp_matches_unsharded_over_steps(mesh_sizes, cfg, seq, overlap, seed) -> None:
    prefetch = mesh_sizes == {"dp": 2, "gtp": 2, "tp": 2}  # one case through the prefetch loop
    cfg = preset("tiny", **{**cfg.__dict__, "tp_overlap": overlap,
                            "unroll_layers": not prefetch})
    pads = run_case(mesh_sizes, cfg, seq, seed % 1000,
                    gtp_jax.GTPConfig(min_elements=0, prefetch=prefetch))
    if cfg.n_heads % mesh_sizes["tp"]:
        assert pads > 0, "expected padded heads"


# --------------------------------------------------------------------------- placement


def test_two_axis_placement_and_local_shapes() -> None:
    """Each weight is TP-split on tp and GTP-sharded on gtp on another dim; the GatherSpec
    describes the TP-local weight; norms and embeddings stay replicated over tp."""
    mesh = gtp_jax.make_mesh(dp=2, gtp=2, tp=2)
    sm = gtp_jax.shard(Transformer(ODD, rngs=nnx.Rngs(0)), mesh,
                       gtp_jax.GTPConfig(min_elements=0))
    layers, d, heads, hd, f = ODD.n_layers, ODD.d_model, 4, ODD.head_size, ODD.d_ff
    expected = {
        # path: (stored shape, stored spec, local logical shape, gtp shard dim per layer)
        "blocks/attn/qkv/kernel": ((layers, d, 3, heads, hd), P(None, "gtp", None, "tp", None),
                                   (d, 3, heads // 2, hd), 0),
        "blocks/attn/out/kernel": ((layers, heads, hd, d), P(None, "tp", "gtp", None),
                                   (heads // 2, hd, d), 1),
        "blocks/mlp/gate_up/kernel": ((layers, d, 2 * f), P(None, "gtp", "tp"), (d, f), 0),
        "blocks/mlp/down/kernel": ((layers, f, d), P(None, "tp", "gtp"), (f // 2, d), 1),
        "embed/embedding": ((ODD.vocab_size + 1, d), P("gtp", None), (ODD.vocab_size, d), 0),
        # the head is sharded on its vocabulary (read as slices where the mesh has no tp)
        "lm_head/kernel": ((d, ODD.vocab_size + 1), P(None, "gtp"), (d, ODD.vocab_size), 1),
    }
    stored = {path_str(k[1:]): v for k, v in flat_values(sm).items()}
    plans = {p.path: p for p in sm.plan}
    assert set(plans) >= set(expected)
    for path, (shape, spec, local, dim) in expected.items():
        value = stored[path]
        assert value.shape == shape, (path, value.shape)
        assert value.sharding.spec == spec, (path, value.sharding.spec)
        assert plans[path].spec.logical_shape == local, path
        assert plans[path].spec.shard_dim == dim, path
        # what one device holds: 1/tp of the TP dim and 1/gtp of the (padded) GTP dim
        piece = list(shape)
        for i, axis in enumerate(spec):
            if axis is not None:
                piece[i] //= mesh.shape[axis]
        assert value.addressable_shards[0].data.shape == tuple(piece), path
    for path in ("blocks/attn_norm/scale", "blocks/mlp_norm/scale", "final_norm/scale"):
        assert stored[path].sharding.spec == P(), path


def test_tp_split_without_gtp_is_placed_and_unshards_exactly() -> None:
    """Excluded from GTP, attention weights are still TP-split (P(tp) only) and the
    fused gate_up permutation and head padding round-trip exactly through unshard."""
    mesh = gtp_jax.make_mesh(gtp=2, tp=4)
    ref = Transformer(ODD, rngs=nnx.Rngs(1))
    sm = gtp_jax.shard(ref, mesh, gtp_jax.GTPConfig(min_elements=0, exclude=("attn/",)))
    split = {p.path: p for p in sm.split_plan}
    assert set(split) == {"blocks/attn/qkv/kernel", "blocks/attn/out/kernel"}
    stored = {path_str(k[1:]): v for k, v in flat_values(sm).items()}
    assert stored["blocks/attn/qkv/kernel"].sharding.spec == P(None, None, None, "tp", None)
    assert stored["blocks/attn/qkv/kernel"].shape == (2, 48, 3, 4, 16)
    full = flat_values(gtp_jax.unshard(sm))
    chex.assert_trees_all_equal({path_str(k): np.asarray(v) for k, v in full.items()},
                                {path_str(k): np.asarray(v) for k, v in flat_values(ref).items()})


def test_fused_gate_up_is_part_interleaved_per_rank() -> None:
    """Rank r of tp holds [gate chunk r | up chunk r] of the fused gate_up kernel."""
    mesh = gtp_jax.make_mesh(gtp=2, tp=4)
    ref = Transformer(ODD, rngs=nnx.Rngs(2))
    sm = gtp_jax.shard(ref, mesh, gtp_jax.GTPConfig(min_elements=0))
    kernel = np.asarray(ref.blocks.mlp.gate_up.kernel[...])  # [L, d, 2f]
    stored = np.asarray(sm.module.blocks.mlp.gate_up.kernel[...])  # [L, d (gtp-padded), 2f]
    f, q = ODD.d_ff, ODD.d_ff // 4
    for r in range(4):
        local = stored[:, : ODD.d_model, r * 2 * q:(r + 1) * 2 * q]
        np.testing.assert_array_equal(local[..., :q], kernel[..., r * q:(r + 1) * q])
        np.testing.assert_array_equal(local[..., q:], kernel[..., f + r * q:f + (r + 1) * q])


# --------------------------------------------------------------------------- compiled structure


@pytest.mark.parametrize("overlap", [True, False])
def test_forward_uses_ring_only_with_overlap(overlap) -> None:
    """Lowered forward (scanned layers: one loop body): with overlap every projection is a
    ring of tp - 1 ppermutes (4 per layer body); without, none."""
    tp = 4
    cfg = preset("tiny", **{**ODD.__dict__, "tp_overlap": overlap, "unroll_layers": False})
    mesh = gtp_jax.make_mesh(gtp=2, tp=tp)
    sm = gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
    graphdef, state = nnx.split(sm)
    tokens = jax.device_put(jnp.zeros((2, 16), jnp.int32), gtp_jax.data_sharding(mesh))
    text = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)).lower(state, tokens).as_text()
    permutes = text.count("stablehlo.collective_permute")
    assert permutes == (4 * (tp - 1) if overlap else 0), permutes


# --------------------------------------------------------------------------- errors


def test_tp_errors_name_the_parameter_and_the_fix() -> None:
    mesh = gtp_jax.make_mesh(gtp=2, tp=4)
    bad_ff = preset("tiny", **{**ODD.__dict__, "d_ff": 66})
    with pytest.raises(ValueError, match=r"gate_up.*multiple of 4"):
        gtp_jax.shard(Transformer(bad_ff, rngs=nnx.Rngs(0)), mesh)

    class Clash(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((8, 8)), gtp_tp_dim=1, gtp_shard_dim=1)

        def __call__(self, x):
            return x @ self.w[...]

    with pytest.raises(ValueError, match=r"'w'.*gtp_shard_dim=1 is also split"):
        gtp_jax.shard(Clash(), mesh, gtp_jax.GTPConfig(min_elements=0))
    with pytest.raises(ValueError, match="tp_overlap"):
        preset("tiny", tp_overlap=("qkv", "mlp"))
