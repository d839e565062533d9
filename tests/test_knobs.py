"""The trainer's optimizer knobs (`gtp_jax.train.step.optim`), gradient accumulation
(`gtp_jax.train.step.train_step.accumulate_grads`), job files (`gtp_jax.train.cli.job_file`) and the
host-memory check of simulated CPU runs (`gtp_jax.train.step.memory.check_host_memory`)."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import Mixed, assert_close, flat_values, get_mesh, mixed_tokens, mse_loss

import gtp_jax
from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.models import lm_loss
from gtp_jax.train import (
    DeviceMemoryError,
    TrainConfig,
    TrainStep,
    build_model_and_optimizer,
    make_optimizer,
    model_config,
)
from gtp_jax.train.cli.command import _parser
from gtp_jax.train.cli.command import main as cli_main
from gtp_jax.train.cli.job_file import PathArg, expand_job_file
from gtp_jax.train.config import model_json, resolve_auto
from gtp_jax.train.lifecycle.resume import check_resume
from gtp_jax.train.step import memory as train_memory
from gtp_jax.train.step.memory import (
    POOL_GROWTH,
    check_host_memory,
    check_pinned_host,
    memory_bound,
    param_sizes,
    pinned_host_bound,
    pinned_host_peak,
    pinned_host_problem,
)
from gtp_jax.train.step.optim import current_lr, lr_schedule
from gtp_jax.train.step.train_step import accumulate_grads

#: float32 on the suite's dp=2 x gtp=4 mesh; 16 rows so 2 microbatches split over 8 shards.
CFG = TrainConfig(steps=2, batch_size=16, seq_len=16, warmup=1, dp=2, gtp=4)


def _batches(cfg: TrainConfig, mesh: jax.sharding.Mesh, count: int = 2) -> list[jax.Array]:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 256, (count, cfg.batch_size, cfg.seq_len + 1)).astype(np.int32)
    return [jax.device_put(t, gtp_jax.data_sharding(mesh)) for t in tokens]


def _run(cfg: TrainConfig) -> tuple[list[float], list[float], dict]:
    model, optimizer = build_model_and_optimizer(cfg)
    step = TrainStep(model, optimizer, lm_loss, grad_accum=cfg.grad_accum)
    losses, lrs = [], []
    for batch in _batches(cfg, model.mesh):
        metrics = step(batch)
        losses.append(float(metrics["loss"]))
        lrs.append(float(metrics["lr"]))
    step.sync()
    return losses, lrs, flat_values(gtp_jax.unshard(model))


def test_grad_accum_gradients_equal_the_whole_batch() -> None:
    """The mean loss and gradient over 2 microbatches of a GTP-sharded module (dp=2 x gtp=4,
    the batch of 16 rows split over the 8 data shards) equal the whole batch's: float32 sums in
    another order, ~1e-6 relative; a wrong row split or a missing 1/N gives O(1) errors."""
    mesh = get_mesh("dp2_gtp4")
    model = gtp_jax.shard(Mixed(nnx.Rngs(0)), mesh)
    batch = jax.device_put(mixed_tokens(jax.random.key(3), batch=16),
                           gtp_jax.data_sharding(mesh))
    whole = jax.jit(lambda m, b: nnx.value_and_grad(mse_loss)(m, b))(model, batch)
    ref = flat_values(whole[1])
    for microbatches in (2,):
        micro = jax.jit(lambda m, b, n=microbatches: accumulate_grads(m, mse_loss, b, n))(
            model, batch)
        assert_close(micro[0], whole[0], 1e-6, "loss")
        grads = flat_values(micro[1])
        assert grads.keys() == ref.keys()
        for key, value in grads.items():
            assert_close(value, ref[key], 1e-5, str(key))
    with pytest.raises(UsageTypeError, match="do not split into 3 equal microbatches"):
        accumulate_grads(model, mse_loss, batch, 3)


def test_grad_accum_matches_one_step_on_the_whole_batch() -> None:
    """Two optimizer steps with 2 microbatches of 8 rows = two steps on 16 rows. float32:
    the loss is a mean of 2 means instead of one (rounding ~1e-7 relative). The gradients
    differ by summation order (~1e-6 relative, checked above); AdamW divides each entry by
    its own magnitude: with the default eps (1e-8) its first update is about +-lr for every
    entry, so an entry whose gradient is rounding noise may move by +-lr either way (1.3e-3
    of the largest entry measured). With eps 1e-5 such entries barely move, and the rest
    agree to 1.4e-5 of each parameter's largest entry (measured). 1e-4 bounds it; a wrong
    microbatch changes the update of most entries by O(lr) = 3e-3 of ~0.1 weights."""
    cfg = dataclasses.replace(CFG, adam_eps=1e-5)
    whole_losses, whole_lrs, whole = _run(cfg)
    accum_losses, accum_lrs, accum = _run(dataclasses.replace(cfg, grad_accum=2))
    assert_close(accum_losses, whole_losses, 1e-6, "losses")
    # The reported LR is the one each update used: the schedule's at counts 0, 1 (steps 1
    # and 2: the one warm-up step at the peak, the last step at the end rate).
    rate = lr_schedule(CFG.peak_lr, CFG.warmup, CFG.steps)
    assert accum_lrs == whole_lrs == [float(rate(0)), float(rate(1))]
    assert accum_lrs == [pytest.approx(CFG.peak_lr, rel=1e-7),
                         pytest.approx(CFG.peak_lr / 10, rel=1e-6)]
    assert accum.keys() == whole.keys()
    for key, value in accum.items():
        assert_close(value, whole[key], 1e-4, str(key))


def test_schedules() -> None:
    lr = 1.0

    def rates(schedule, n):  # the rate of steps 1..n (counts 0..n-1)
        return [float(schedule(i)) for i in range(n)]

    wsd = lr_schedule(lr, 2, 10, schedule="wsd", decay_steps=4)
    # warm-up .5, 1; stable 1.0 for steps 3..6; linear decay over steps 7..10 to 10%.
    np.testing.assert_allclose(rates(wsd, 12), [.5, 1, 1, 1, 1, 1, .775, .55, .325, .1, .1, .1],
                               atol=1e-6)
    lin = lr_schedule(lr, 0, 4, schedule="linear")
    np.testing.assert_allclose(rates(lin, 6), [.775, .55, .325, .1, .1, .1], atol=1e-6)
    const = lr_schedule(lr, 2, 10, schedule="constant")
    np.testing.assert_allclose(rates(const, 4), [.5, 1, 1, 1], atol=1e-6)
    # The default wsd decays over the last 20% of the steps after the warm-up.
    wsd = lr_schedule(lr, 0, 10, schedule="wsd")
    assert rates(wsd, 10)[7] == 1.0 and rates(wsd, 10)[8] == pytest.approx(0.55)
    # Version 1 (runs started before version 2): optax's schedules of the update count.
    wsd = lr_schedule(lr, 2, 10, schedule="wsd", decay_steps=4, version=1)
    np.testing.assert_allclose(rates(wsd, 12), [0, .5, 1, 1, 1, 1, 1, .775, .55, .325, .1, .1],
                               atol=1e-6)
    short = lr_schedule(lr, 10, 4, schedule="wsd", version=1)
    np.testing.assert_allclose(rates(short, 4), [0, .1, .2, .3], atol=1e-6)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd", "constant"])
@pytest.mark.parametrize("steps, warmup", [(6, None), (12, None), (40, None), (100, None),
                                           (6, 2), (20, 19), (1, None)])
def test_every_step_trains_and_the_schedule_ends_where_the_docs_say(schedule, steps,
                                                                    warmup) -> None:
    """Step 1 trains (it used to train at rate 0); the warm-up rises to the peak; the last
    step of a decaying schedule trains at 10% of lr and so does every step added later (an
    extended 6-step run with the old default 10-step warm-up climbed back to the peak, then
    dropped 10x in one step)."""
    if schedule == "constant" and steps == 20:
        warmup = 20  # the constant schedule may warm up over all of its steps
    cfg = TrainConfig(steps=steps, warmup=warmup, lr_schedule=schedule).with_schedule()
    lr, w = cfg.lr, cfg.warmup
    rate = lr_schedule(lr, w, steps, schedule=schedule)
    got = [float(rate(k - 1)) for k in range(1, 3 * steps + 1)]  # steps 1 .. 3 * steps
    assert got[0] > 0
    np.testing.assert_allclose(got[:w], [lr * k / w for k in range(1, w + 1)], rtol=1e-6)
    end = lr if schedule == "constant" else lr / 10
    np.testing.assert_allclose(got[steps - 1:], end, rtol=1e-6)  # the last step and after
    assert all(a >= b - 1e-9 for a, b in zip(got[w:], got[w + 1:]))  # no rise after warm-up


def test_default_warmup_is_a_small_part_of_short_runs() -> None:
    # The README's runs (6, 10, 40 steps) were all warm-up with the old default of 10.
    assert [TrainConfig(steps=n).with_schedule().warmup
            for n in (1, 6, 10, 40, 100, 5000)] == [0, 0, 1, 4, 10, 10]
    # Refused once the schedule is fixed (a resumed run keeps its checkpoint's length).
    with pytest.raises(UsageError, match=r"TrainConfig\.warmup=10 leaves no step of the "
                                         r"6-step schedule .*warmup <= 5, or leave it unset"):
        TrainConfig(steps=6, warmup=10).with_schedule()


def test_a_checkpoint_keeps_the_schedule_it_started_with() -> None:
    """Recorded once: an extension keeps its warm-up (not a default of the new length), and
    a checkpoint of version 1 (none recorded) resumes with version 1's rates."""
    first = resolve_auto(TrainConfig(steps=6, batch_size=16, seq_len=16, dp=2, gtp=4))
    saved = first.with_schedule()
    extended = dataclasses.replace(first, steps=120)  # default warm-up of 120 steps: 10
    kept = check_resume(extended, model_config(extended), _meta(saved), "d")
    assert (kept.warmup, kept.schedule_steps, kept.schedule_version) == (0, 6, 2)
    # Written before version 2: warm-up 10 recorded, no schedule_version.
    old = dataclasses.replace(saved, warmup=10, schedule_version=1)
    meta = _meta(old, drop=("schedule_version",))
    resumed = check_resume(extended, model_config(extended), meta, "d")
    assert (resumed.warmup, resumed.schedule_steps, resumed.schedule_version) == (10, 6, 1)
    before = optax.schedules.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=10,
                                                          decay_steps=11, end_value=3e-4)
    tx = make_optimizer(resumed)
    params = {"w": jnp.ones((2,))}
    state = tx.init(params)
    for count in range(13):
        _, state = tx.update({"w": jnp.ones((2,))}, state, params)
        assert float(current_lr(state)) == pytest.approx(float(before(count)), rel=1e-6)
    with pytest.raises(UsageError, match="schedule_version"):  # not this run's schedule
        check_resume(dataclasses.replace(extended, schedule_version=2), model_config(extended),
                     meta, "d")


def test_default_optimizer_updates_as_before() -> None:
    """Schedule version 1 reproduces the optimizer of earlier versions (their runs resume
    with it)."""
    cfg = TrainConfig(steps=20, warmup=3, lr=1e-2, schedule_version=1)
    old = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=3, decay_steps=20,
                                           end_value=1e-3), b2=0.95, weight_decay=0.1))
    new = make_optimizer(cfg)
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)}
    old_state, new_state = old.init(params), new.init(params)
    for i in range(6):
        grads = {"w": jnp.sin(params["w"] * (i + 1)) * (3.0 if i % 2 else 0.1)}
        u_old, old_state = old.update(grads, old_state, params)
        u_new, new_state = new.update(grads, new_state, params)
        np.testing.assert_allclose(u_new["w"], u_old["w"], rtol=1e-6, atol=1e-9)


def test_clip_and_betas_reach_the_optimizer() -> None:
    params = {"w": jnp.ones((4,))}
    grads = {"w": jnp.full((4,), 10.0)}  # global norm 20
    for clip, b1, b2 in ((0.0, 0.9, 0.95), (0.5, 0.9, 0.95), (1.0, 0.5, 0.99)):
        cfg = TrainConfig(steps=10, warmup=0, clip_grad_norm=clip, adam_b1=b1, adam_b2=b2,
                          weight_decay=0.0, lr_schedule="constant")
        ref = optax.adam(cfg.peak_lr, b1=b1, b2=b2)
        tx = make_optimizer(cfg)
        state, ref_state = tx.init(params), ref.init(params)
        for scale in (1.0, 0.1):
            g = {"w": grads["w"] * scale}
            factor = 1.0 if clip == 0 else min(1.0, clip / float(optax.tree.norm(g)))
            clipped = {"w": g["w"] * factor}
            update, state = tx.update(g, state, params)
            expected, ref_state = ref.update(clipped, ref_state, params)
            np.testing.assert_allclose(update["w"], expected["w"], rtol=1e-5)


@pytest.mark.parametrize("kwargs, needle", [
    ({"lr_schedule": "step"}, "TrainConfig.lr_schedule='step'"),
    ({"clip_grad_norm": -1.0}, "TrainConfig.clip_grad_norm=-1.0"),
    ({"adam_b1": 1.0}, "TrainConfig.adam_b1=1.0"),
    ({"adam_eps": 0.0}, "TrainConfig.adam_eps=0.0"),
    ({"decay_steps": 0}, "TrainConfig.decay_steps=0"),
    ({"lr_schedule": "constant", "decay_steps": 5}, "constant schedule has no decay"),
    ({"lr_schedule": "wsd", "decay_steps": 95}, "TrainConfig.decay_steps <= 90"),
    ({"grad_accum": 0}, "TrainConfig.grad_accum=0"),
    ({"grad_accum": 3}, "grad_accum*dp*ep*gtp"),
])
def test_bad_optimizer_settings(kwargs, needle) -> None:
    with pytest.raises(UsageError) as err:
        TrainConfig(**kwargs)
    assert needle in str(err.value)


def _meta(cfg: TrainConfig, *, drop: tuple[str, ...] = ()) -> dict:
    saved = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in drop}
    return {"step": 1, "extra": {"train_config": saved,
                                 "model_config": model_json(model_config(cfg)),
                                 "data": {"position": 1}}}


def test_resume_refuses_other_optimizer_settings_allows_other_grad_accum() -> None:
    saved = resolve_auto(dataclasses.replace(CFG, steps=4))
    for change in ({"clip_grad_norm": 0.5}, {"adam_b2": 0.99}, {"lr_schedule": "wsd"}):
        other = dataclasses.replace(saved, **change)
        with pytest.raises(UsageError, match="belongs to a different run") as err:
            check_resume(other, model_config(other), _meta(saved), "d")
        assert next(iter(change)) in str(err.value)
    same = dataclasses.replace(saved, grad_accum=2)
    assert check_resume(same, model_config(same), _meta(saved), "d").grad_accum == 2
    # A checkpoint of a version without these fields trained with their defaults.
    new_fields = ("lr_schedule", "decay_steps", "clip_grad_norm", "adam_b1", "adam_b2",
                  "adam_eps", "grad_accum")
    check_resume(saved, model_config(saved), _meta(saved, drop=new_fields), "d")
    clipped = dataclasses.replace(saved, clip_grad_norm=2.0)
    with pytest.raises(UsageError, match="clip_grad_norm"):
        check_resume(clipped, model_config(clipped), _meta(saved, drop=new_fields), "d")


def _args(tmp_path, text: str, *flags: str):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return _parser().parse_args(expand_job_file(_parser(), ["train", "--config", str(path),
                                                            *flags]))


def test_job_file_sets_flags_and_flags_override(tmp_path) -> None:
    text = ('steps = 7\nlr = 0.001\ngrad-accum = 2\nlr-schedule = "wsd"\noverlap = true\n'
            'unroll-layers = false\ndata = ["a.txt", "b.txt"]\nlog-dir = "logs"\n')
    args = _args(tmp_path, text)
    assert (args.steps, args.lr, args.grad_accum, args.lr_schedule) == (7, 1e-3, 2, "wsd")
    assert args.overlap is True and args.unroll_layers is False
    # Relative to the job file's folder (test_job_file_paths_are_relative_to_the_file).
    assert args.data == [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    assert args.log_dir == str(tmp_path / "logs")
    args = _args(tmp_path, text, "--steps", "9", "--lr-schedule=cosine", "--unroll-layers")
    assert (args.steps, args.lr_schedule, args.unroll_layers, args.lr) == (9, "cosine", True,
                                                                           1e-3)
    # Every on/off flag a file turns on, the command line turns off (and the other way).
    switches = ("overlap", "prefetch", "keep-gathered-layers", "deterministic",
                "offload-master-weights", "offload-optimizer", "unroll-layers",
                "coalesce-layer-collectives")
    on = "".join(f"{k} = true\n" for k in switches)
    args = vars(_args(tmp_path, on, *(f"--no-{k}" for k in switches)))
    assert [args[k.replace("-", "_")] for k in switches] == [False] * len(switches)
    off = "".join(f"{k} = false\n" for k in switches)
    args = vars(_args(tmp_path, off, *(f"--{k}" for k in switches)))
    assert [args[k.replace("-", "_")] for k in switches] == [True] * len(switches)


@pytest.mark.parametrize("text, needle", [
    ("grad_accum = 2\n", "unknown key 'grad_accum'; did you mean 'grad-accum'?"),
    ("stpes = 2\n", "did you mean 'steps'?"),
    ("overlap = 1\n", "key 'overlap' must be true or false"),
    ("steps = [1]\n", "key 'steps' must be a string or a number"),
    ("[train]\nsteps = 2\n", "unknown key 'train'"),
    ("steps = \n", "is not valid TOML"),
    ("config = 'x.toml'\n", "unknown key 'config'"),
])
def test_job_file_errors_name_the_key(tmp_path, capsys, text, needle) -> None:
    path = tmp_path / "job.toml"
    path.write_text(text)
    assert cli_main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_host_memory_refusal() -> None:
    cfg = TrainConfig(preset="1b", steps=2)
    need = memory_bound(cfg)["total"] * jax.local_device_count()
    check_host_memory(cfg, available=need)  # exactly enough: accepted
    with pytest.raises(DeviceMemoryError) as err:
        check_host_memory(cfg, available=need - 1)
    text = str(err.value)
    assert "x 8 simulated CPU devices" in text and "TrainConfig.batch_size" in text
    assert "such as '100m'" in text  # the largest smaller preset that fits


def test_pinned_host_refusal_names_the_pool_and_the_fix() -> None:
    cfg = TrainConfig(preset="1b", steps=2, gtp=8, dp=1, offload_optimizer=True)
    state = pinned_host_bound(cfg)
    # AdamW's two float32 moments of every parameter, an eighth per device
    assert state == 2 * 4 * model_config(cfg).num_params() // 8
    assert pinned_host_bound(dataclasses.replace(cfg, offload_optimizer=False)) == 0
    # and the largest layer-stacked moment once more, held twice while it is regrouped
    largest = max(n for path, n in param_sizes(model_config(cfg)) if path.startswith("blocks/"))
    need = pinned_host_peak(cfg)
    assert need == state + 4 * largest // 8
    assert pinned_host_problem(dataclasses.replace(cfg, offload_optimizer=False), pool_bytes=0,
                               available_bytes=0, local_devices=8) is None
    check_pinned_host(cfg, pool_bytes=need, available=8 * need)  # exactly enough: accepted
    with pytest.raises(DeviceMemoryError) as err:
        check_pinned_host(cfg, pool_bytes=need - 1, available=8 * need)
    text = str(err.value)
    assert f"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={-(-need // 2**30)}" in text
    assert "TrainConfig.gtp" in text and "offload_optimizer=False" in text
    with pytest.raises(DeviceMemoryError, match="x 8 devices in this process"):
        check_pinned_host(cfg, pool_bytes=need, available=8 * need - 1)


def test_pinned_pools_that_could_outgrow_the_host_are_refused_with_the_cap_that_fits() -> None:
    """XLA's pinned pool grows in doubling regions up to its cap: where the caps of this
    process's devices exceed the host's memory and the state is a large part of it, the
    pools could take it all while the state is built (the kernel ends the process)."""
    cfg = TrainConfig(preset="1b", steps=2, gtp=8, dp=1, offload_optimizer=True)
    gib = 2**30
    need = pinned_host_peak(cfg)
    available = 20 * need  # holds the 8 devices' states, not three times them
    with pytest.raises(DeviceMemoryError) as err:
        check_pinned_host(cfg, pool_bytes=available, available=available)
    fit = int(available * 0.9) // 8 // gib
    assert fit * gib >= need
    text = str(err.value)
    assert "doubling size" in text and f"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={fit} " in text
    check_pinned_host(cfg, pool_bytes=fit * gib, available=available)  # the fix: accepted
    # a small state beside a large cap cannot grow the pools past the host: accepted
    check_pinned_host(cfg, pool_bytes=available, available=8 * POOL_GROWTH * need)
    # no cap would both hold the state and fit: the other fixes only
    with pytest.raises(DeviceMemoryError) as err:
        check_pinned_host(cfg, pool_bytes=available, available=9 * need)
    assert "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=" not in str(err.value)
    assert "TrainConfig.gtp" in str(err.value)


def test_host_memory_refusal_at_the_cli(monkeypatch, capsys) -> None:
    monkeypatch.setattr(train_memory.host, "available_bytes", lambda: 2 * 2**30)
    assert cli_main(["train", "--preset", "1b", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "of host memory, but 2.00 GiB are available" in err
    assert "--preset such as 'small'" in err and "--batch" in err and "--seq" in err


def test_the_clip_takes_the_global_norm_in_float32_and_matches_optax_on_float32():
    from gtp_jax.train.step.optim import clip_by_global_norm

    rng = np.random.default_rng(0)
    wide = [jnp.asarray(rng.normal(size=(4096,)), jnp.float32) for _ in range(300)]
    # float32 gradients: optax's own arithmetic, bit for bit
    ours, _ = clip_by_global_norm(1.0).update(wide, optax.EmptyState())
    theirs, _ = optax.clip_by_global_norm(1.0).update(wide, optax.EmptyState())
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)
    # bfloat16 gradients: the norm of the float32 values, not a bfloat16 running sum
    narrow = [g.astype(jnp.bfloat16) for g in wide]
    norm = float(np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float32))) for g in narrow)))
    naive = float(optax.tree.norm(narrow))
    assert abs(naive - norm) / norm > 1e-3  # what optax alone would clip by
    clipped, _ = clip_by_global_norm(norm / 2).update(narrow, optax.EmptyState())
    got = float(np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float32))) for g in clipped)))
    assert got == pytest.approx(norm / 2, rel=1e-2)  # bfloat16 rounding of each element
    kept, _ = clip_by_global_norm(norm * 1.0001).update(narrow, optax.EmptyState())
    for a, b in zip(kept, narrow):  # under the threshold: unchanged
        np.testing.assert_array_equal(a, b)


def test_job_file_that_is_not_utf8_is_one_line(tmp_path, capsys) -> None:
    path = tmp_path / "job.toml"
    path.write_bytes(b"steps = 2\n# caf\xe9 in Latin-1\n")
    assert cli_main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not UTF-8 text (byte 0xe9" in err, err


def test_job_file_paths_are_relative_to_the_file(tmp_path, monkeypatch) -> None:
    """A job requeued from another folder finds its checkpoints, data and logs again: the
    file's relative paths name the same places wherever the command runs."""
    jobs, elsewhere = tmp_path / "jobs", tmp_path / "elsewhere"
    jobs.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    text = ('checkpoint-dir = "runs/a"\ndata = ["corpus/a.txt", "/abs/b.txt"]\n'
            'tokenizer = "tok/tokenizer.json"\nlog-dir = "~/logs"\ncompile-cache = "off"\n'
            'init-from = "gs://bucket/run"\nmetrics-json = "m.json"\n')
    path = jobs / "job.toml"
    path.write_text(text)
    args = _parser().parse_args(expand_job_file(_parser(), ["train", "--config", "../jobs/job.toml",
                                                            "--export-hf", "out"]))
    assert args.checkpoint_dir == str(jobs / "runs/a")
    assert args.data == [str(jobs / "corpus/a.txt"), "/abs/b.txt"]
    assert args.tokenizer == str(jobs / "tok/tokenizer.json")
    assert args.metrics_json == str(jobs / "m.json")
    assert args.log_dir == os.path.expanduser("~/logs")
    assert (args.compile_cache, args.init_from) == ("off", "gs://bucket/run")
    assert args.export_hf == "out"  # the command line's own paths: the working folder's


def test_every_path_flag_is_marked_for_job_files() -> None:
    """A path flag added later without `PathArg` would resolve against the working folder
    from a job file: every flag that names a file or folder must carry it."""
    train = next(a for a in _parser()._actions if a.dest == "command").choices["train"]
    paths = {a.option_strings[0] for a in train._actions
             if a.metavar in ("DIR", "PATH") or a.dest.endswith(("_dir", "_json"))
             or a.dest in ("data", "val_data", "tokenizer", "init_from", "export_hf")}
    paths.discard("--config")
    unmarked = sorted(f for f in paths
                      if not isinstance(next(a for a in train._actions
                                             if f in a.option_strings).type, PathArg))
    assert len(paths) >= 12 and not unmarked, unmarked


@pytest.mark.parametrize("text, resume", [("resume = true\n", True),
                                          ('resume = "auto"\n', "auto"),
                                          ("resume = false\n", False)])
def test_job_file_resume_takes_a_bool_or_auto(tmp_path, text, resume) -> None:
    assert _args(tmp_path, 'checkpoint-dir = "ck"\n' + text).resume == resume


def test_reduce_dtype_reaches_the_gathers_and_the_header():
    from gtp_jax.train.config import describe_choices, gtp_config, model_config

    cfg = TrainConfig(reduce_dtype="bfloat16")
    assert gtp_config(cfg).reduce_dtype == jnp.bfloat16
    assert gtp_config(TrainConfig()).reduce_dtype == jnp.float32
    assert "reduce-scattered in bfloat16" in describe_choices(cfg, model_config(cfg))
    with pytest.raises(UsageError, match="TrainConfig.reduce_dtype"):
        TrainConfig(reduce_dtype="float16")


def test_a_run_is_resolved_once(monkeypatch):
    # TrainConfig and the devices go in, a resolved Run comes out; the memory checks, the
    # model, the step and the header read it, and nothing resolves the config again.
    from gtp_jax.train import config as train_config
    from gtp_jax.train import resolve, train

    calls = []
    real = train_config.resolve_auto
    monkeypatch.setattr(train_config, "resolve_auto",
                        lambda cfg, backend=None: calls.append(cfg) or real(cfg, backend))
    models = []
    real_model = train_config._model_config
    monkeypatch.setattr(train_config, "_model_config",
                        lambda cfg: models.append(cfg) or real_model(cfg))
    train(TrainConfig(steps=2, batch_size=8, seq_len=32), progress=False)
    assert len(calls) == 1 and len(models) == 1
    run = resolve(TrainConfig())
    assert resolve(run) is run and run.config.auto_fields == frozenset()
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.model = None


@pytest.mark.parametrize(("fp8", "given", "unrolled"), [
    (None, None, True), ("delayed", None, False), ("tensorwise", None, False),
    ("delayed", True, True), (None, False, False)])
def test_fp8_compute_runs_the_scanned_loop_unless_told(fp8, given, unrolled) -> None:
    """FP8's unrolled program compiles ten times longer for a few percent of step time: the
    trainer scans its layers unless --unroll-layers says otherwise."""
    from gtp_jax.train import TrainConfig
    from gtp_jax.train.config import model_config

    cfg = TrainConfig(preset="tiny", fp8_compute=fp8, unroll_layers=given, gtp=1, dp=1)
    assert model_config(cfg).unrolled is unrolled


def test_keep_gathered_layers_trains_like_the_default() -> None:
    """`TrainConfig.keep_gathered_layers` (``--keep-gathered-layers``) changes where the
    backward pass's weights come from (the forward pass's gathers, held), not what they are:
    the same losses and parameters (float32; the gathers are exact copies, so only XLA's
    fusion choices may move the last bit)."""
    keep = dataclasses.replace(CFG, keep_gathered_layers=True)
    base, kept = _run(CFG), _run(keep)
    np.testing.assert_allclose(kept[0], base[0], rtol=1e-6)
    for path, value in base[2].items():
        assert_close(kept[2][path], value, 1e-6, str(path))

    def gathers(cfg: TrainConfig) -> int:
        """All-gathers in the step's program: the backward pass gathers each layer again
        unless the forward pass's gathers are kept."""
        model, optimizer = build_model_and_optimizer(cfg)
        step = TrainStep(model, optimizer, lm_loss)
        batch = _batches(cfg, model.mesh, 1)[0]
        return step._program.fn.lower(step.state, batch).as_text().count("all_gather")

    assert gathers(keep) < gathers(CFG)


def test_memory_bound_counts_the_kept_gathered_weights() -> None:
    """Kept gathered weights are held from the forward pass to the backward pass, beside the
    saved activations: every layer-stacked weight, whole over gtp (float32 gathers here)."""
    from gtp_jax.base.metadata import STACKED
    from gtp_jax.models import Transformer

    kept = dataclasses.replace(CFG, keep_gathered_layers=True)
    model = nnx.eval_shape(lambda: Transformer(model_config(kept), rngs=nnx.Rngs(0)))
    stacked = sum(v.get_value().size for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
                  if v.get_metadata().get(STACKED, False))
    gained = memory_bound(kept)["activations"] - memory_bound(CFG)["activations"]
    assert gained == stacked * 4


def test_keep_gathered_layers_flag_and_its_refusal_with_the_planner(capsys) -> None:
    args = _parser().parse_args(["train", "--keep-gathered-layers"])
    assert args.keep_gathered_layers is True
    assert cli_main(["train", "--steps", "1", "--plan", "auto", "--keep-gathered-layers"]) == 2
    err = capsys.readouterr().err
    assert "--keep-gathered-layers" in err and "--plan auto" in err
    with pytest.raises(UsageTypeError, match="keep_gathered_layers"):
        TrainConfig(keep_gathered_layers="yes")
