"""Resuming a run: which checkpoint to continue from, whether it belongs to this run, and
restoring it (skipping damaged ones in favour of older intact ones)."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from gtp_jax.base.errors import UsageError
from gtp_jax.models import TransformerConfig
from gtp_jax.train.config import (
    COMPARED_AS_MODEL,
    MODEL_MAY_DIFFER,
    RESUME_MAY_DIFFER,
    Run,
    TrainConfig,
    adopt_saved,
    model_config,
    model_differences,
    resolve,
    resolve_auto,
)
from gtp_jax.train.data_source import check_source
from gtp_jax.train.lifecycle.checkpoint import CheckpointCorruptError, Checkpointer
from gtp_jax.train.step import optim
from gtp_jax.train.user_model import UserModel

#: (step, metadata) of a checkpoint that may be resumed from, newest first.
Candidate = tuple[int, dict[str, Any]]


class RunFinished(Exception):  # noqa: N818 - not an error: the run is complete
    """Resuming a run that already trained every step asked for (same ``steps``): nothing
    is left to do. Not an error (a scheduler that re-queues a completed job does this);
    the command line prints `message` and exits with status 0.

    Attributes:
      directory: the checkpoint directory.
      step: the step of the run's final (verified) checkpoint, equal to ``steps``.
      export_hf: where the final checkpoint's Hugging Face export was written (a run
        re-launched with ``TrainConfig.export_hf``), or None.
    """

    def __init__(self, directory: str, step: int, export_hf: str | None = None):
        self.directory, self.step, self.export_hf = directory, step, export_hf
        super().__init__(self.message)

    @property
    def message(self) -> str:
        """One line: finished at which step, where its checkpoint is, where its Hugging Face
        export was written, how to extend it."""
        exported = ("" if self.export_hf is None else
                    f"; wrote its Hugging Face export to {self.export_hf!r}")
        return (f"the run in {self.directory!r} is finished (checkpoint at step {self.step}); "
                f"nothing to train{exported}. To extend it, pass a larger TrainConfig.steps "
                f"(e.g. TrainConfig.steps={self.step + max(1, self.step // 5)}).")


class StartOver(Exception):  # noqa: N818 - not an error: what happens next
    """Under ``CheckpointConfig.resume="auto"`` every checkpoint failed its checksums when
    restored: each was renamed aside (one line on stderr) and the run starts over from
    step 0. Raised before the model or optimizer changed; `gtp_jax.train.train` catches it
    and sets the run up again as a new one."""


def note(line: str) -> None:
    """One line on stderr from process 0 (skipped checkpoints and the like)."""
    if jax.process_index() == 0:
        print(f"gtp_jax train: {line}", file=sys.stderr, flush=True)


def select_candidates(run: Run, ckpt: Checkpointer | None, *,
                      auto: frozenset[str] = frozenset(),
                      source: dict[str, Any] | None = None,
                      keep_finished: bool = False) -> tuple[Run, list[Candidate]]:
    """The checkpoints to try to resume from, newest first (none for a new run), and `run`
    with the saved run's ``schedule_steps`` (and, for the fields named in `auto`, left on
    "auto" by the user, the saved run's values: then resolved once more, as the run it now
    is); checked before anything is built.
    `source` is the run's data-source record (`gtp_jax.train.data_source`; None: not
    checked).

    With ``CheckpointConfig.resume="auto"`` a directory without checkpoints (missing,
    empty, or holding only a save that never finished) starts a new run; so does one whose
    checkpoints are all damaged, once each is renamed ``broken-<step>-<n>`` (not deleted;
    one line on stderr says so), so that the same requeued command never fails the same
    way forever. ``resume=True`` refuses that directory instead.

    With `keep_finished` (the run is to export its final checkpoint) a finished run's
    checkpoint is returned first instead of raising `RunFinished`.

    Raises:
      RunFinished: the newest intact checkpoint is of this run, at step ``cfg.steps``.
      UsageError: resume without an intact checkpoint, a checkpoint of another run or one
        past ``cfg.steps``; a new run in a directory that holds checkpoints.
    """
    if ckpt is None:
        return run, []
    cfg, model_cfg = run.config, run.model
    directory = ckpt.config.directory
    candidates = intact_candidates(ckpt)
    if not candidates:
        return run, []
    cfg = check_resume(cfg, model_cfg, candidates[0][1], directory, steps_left=False,
                       auto=auto, source=source)
    if cfg is not run.config:  # the saved run's schedule and choices: that run, resolved
        given, run = run, resolve(cfg, run.backend)
        cfg, model_cfg = run.config, run.model
    else:
        given = run

    def check(meta: dict[str, Any], steps_left: bool) -> None:
        check_resume(cfg, model_cfg, meta, directory, steps_left=steps_left, source=source)

    candidates = drop_finished(ckpt, candidates, cfg.steps, check,
                               keep_finished=keep_finished)
    return (run, candidates) if candidates else (given, [])


def intact_candidates(ckpt: Checkpointer) -> list[Candidate]:
    """The intact checkpoints of `ckpt` to resume from, newest first, by
    `CheckpointConfig.resume`: none for a new run (``resume=False``, whose directory must
    hold no checkpoint; ``"auto"`` where nothing was saved, or where every save is damaged,
    once each is renamed ``broken-<step>-<n>``); ``resume=True`` refuses a directory without
    an intact one. Each damaged checkpoint skipped is reported on stderr.

    Raises:
      UsageError: a new run in a directory that holds checkpoints; ``resume=True`` without
        an intact checkpoint.
    """
    directory = ckpt.config.directory
    if not ckpt.config.resume:
        if ckpt.latest_step() is not None:
            raise UsageError(
                f"CheckpointConfig.directory {directory!r} already holds "
                f"checkpoints (steps {ckpt.all_steps()}); set CheckpointConfig.resume to "
                "continue that run (CheckpointConfig.resume='auto': continue if there are "
                "checkpoints, else start), or use an empty directory for a new run."
            )
        return []
    if ckpt.config.resume == "auto" and not ckpt.holds_saves():
        return []  # nothing was ever saved here: a new run
    candidates = ckpt.resume_candidates(report=note)
    if not candidates:
        if ckpt.config.resume == "auto":
            set_all_aside(ckpt)
            return []
        raise _no_intact(directory, skipped=ckpt.holds_saves())
    return candidates


def drop_finished(ckpt: Checkpointer, candidates: list[Candidate], steps: int,
                  check: Callable[[dict[str, Any], bool], None], *,
                  keep_finished: bool = False) -> list[Candidate]:
    """`candidates` without the newest ones at or past `steps` that turn out damaged
    (verified, reported, skipped: an older intact one may still have steps left).

    ``check(meta, steps_left)`` raises `UsageError` for a checkpoint the run cannot continue
    (with `steps_left`: also for one with no steps left); it is called with False on an
    intact checkpoint at or past `steps` before the run is reported finished, and with True
    on one past `steps`, which must raise.

    Raises:
      RunFinished: the newest intact checkpoint is at step `steps` (returned first instead
        with `keep_finished`).
      UsageError: it is past `steps` (`check`), or none is left and
        ``CheckpointConfig.resume`` is not "auto" (with "auto", every one is renamed aside
        and none is returned: a new run).
    """
    candidates = list(candidates)
    directory = ckpt.config.directory
    while candidates and candidates[0][0] >= steps:
        # Nothing left to train from this one, unless it is damaged: verify it
        # before saying so (an older intact checkpoint may still have steps left).
        try:
            ckpt.verify(candidates[0][0])
        except CheckpointCorruptError as err:
            note(f"skipping {err}")
            candidates.pop(0)
            continue
        check(candidates[0][1], False)
        if candidates[0][0] == steps:
            if keep_finished:  # the caller restores it (to export it) and says it is done
                return candidates
            raise RunFinished(directory, steps)
        check(candidates[0][1], True)  # past the last step: refused
        raise UsageError(f"the checkpoint in {directory!r} is past the run's {steps} steps.")
    if not candidates:
        if ckpt.config.resume == "auto":
            set_all_aside(ckpt)
            return []
        raise _no_intact(directory, skipped=True)
    return candidates


#: Fields that name a folder: the same folder however it is spelled (``./d/`` and ``d``).
_PATH_FIELDS = frozenset({"init_from", "init_from_hf"})


def _same(field: str, saved: Any, now: Any) -> bool:
    """Whether a run's `field` is the same in the checkpoint (`saved`) and now."""
    if saved == now:
        return True
    if field in _PATH_FIELDS and isinstance(saved, str) and isinstance(now, str):
        return "://" not in saved + now and os.path.realpath(saved) == os.path.realpath(now)
    return False


def _no_intact(directory: str, *, skipped: bool) -> UsageError:
    """The refusal of ``resume=True`` without an intact checkpoint (`skipped`: each of
    those in `directory` was reported damaged above)."""
    return UsageError(
        f"no intact checkpoint in {directory!r} to resume from"
        f"{' (each was skipped, see above)' if skipped else ''}; pass the "
        "CheckpointConfig.directory of an earlier run, or CheckpointConfig.resume='auto' "
        "(which starts a new run where nothing was saved, and renames damaged checkpoints "
        "aside to start over).")


def set_all_aside(ckpt: Checkpointer) -> None:
    """Renames every finalized checkpoint of `ckpt` (all damaged) to ``broken-<step>-<n>``
    and says in one line that the run starts over from step 0."""
    moved = ckpt.set_aside_newer(-1)
    note(f"no intact checkpoint in {ckpt.config.directory!r} to resume from: renamed the "
         f"damaged {', '.join(moved) or 'checkpoints'} aside (not deleted); starting a new "
         "run from step 0")


def restore_newest(ckpt: Checkpointer | None, candidates: list[Candidate], model: nnx.Module,
                   optimizer: nnx.Optimizer, *,
                   check: Callable[[dict[str, Any]], None] | None = None
                   ) -> tuple[dict[str, Any] | None, int]:
    """Restores the newest intact candidate into `model` and `optimizer`; returns its
    metadata and step, or ``(None, 0)`` for a new run.

    ``check(meta)`` (optional) raises `UsageError` for a candidate the run cannot continue.
    A checkpoint whose arrays fail their checksums (or cannot be read) is skipped in favour
    of the next older one; the objects are only changed by a restore that verified. Damaged
    checkpoints newer than the one restored are renamed aside (not deleted).

    Raises:
      StartOver: every candidate was damaged, under ``CheckpointConfig.resume="auto"``
        (all were renamed aside).
      UsageError: every candidate was damaged.
    """
    if not candidates:
        return None, 0
    for step, candidate in candidates:
        try:
            if check is not None:
                check(candidate)
            ckpt.restore(model, optimizer, step=step)
        except CheckpointCorruptError as err:
            note(f"skipping {err}")
            continue
        for moved in ckpt.set_aside_newer(step):
            note(f"renamed the damaged checkpoint newer than step {step} to {moved} "
                 "(not deleted; this run saves those steps again)")
        return candidate, step
    if ckpt.config.resume == "auto":
        set_all_aside(ckpt)
        raise StartOver
    raise _no_intact(ckpt.config.directory, skipped=True)


def check_resume(cfg: TrainConfig, model_cfg: TransformerConfig | UserModel,
                 meta: dict[str, Any], directory: str, *, steps_left: bool = True,
                 auto: frozenset[str] = frozenset(),
                 source: dict[str, Any] | None = None) -> TrainConfig:
    """Raises UsageError unless checkpoint `meta` belongs to a run `cfg` can continue (and,
    with `steps_left`, has steps left to train); with `source` (the run's data-source
    record), unless the checkpoint was trained on the same data and tokenizer.

    Returns `cfg` with ``lr``, ``schedule_steps``, ``warmup`` and ``schedule_version`` (those
    left None) set to the saved run's, so that a resumed or extended run keeps its original
    LR schedule (also when the defaults changed since: a preset's own LR and warm-up,
    `gtp_jax.train.step.lr_defaults`), and the fields
    named in `auto` (`TrainConfig.auto_fields` of the caller's config) set to the saved
    run's values.
    """
    extra = meta.get("extra", {})
    saved_cfg, saved_model = extra.get("train_config"), extra.get("model_config")
    if (not isinstance(saved_cfg, dict) or not isinstance(saved_model, dict)
            or not isinstance(extra.get("data"), dict)):
        raise UsageError(
            f"checkpoint in {directory!r} (step {meta.get('step')}) was not written by "
            "`python -m gtp_jax train`; point CheckpointConfig.directory at a training run's "
            "checkpoints."
        )
    if source is not None:  # first: other data also changes the vocabulary
        check_source(extra.get("data_source"), source, directory)
    auto = auto | cfg.auto_fields  # a config still on "auto" continues the saved choices
    if auto:
        adopted = resolve_auto(adopt_saved(cfg, saved_cfg, auto))
        if adopted is not cfg:
            cfg, model_cfg = adopted, model_config(adopted)
    # The schedule the run started with: its peak LR and length, its warm-up (a default
    # one was fixed then; none recorded: the default of that time, a tenth of the steps at
    # most 10, whatever the preset's default is now) and the version of its step-to-rate
    # mapping (none recorded: version 1).
    schedule_steps = saved_cfg.get("schedule_steps") or saved_cfg.get("steps")
    warmup = saved_cfg.get("warmup")
    if warmup is None and isinstance(schedule_steps, int):
        warmup = optim.default_warmup(schedule_steps)
    saved_schedule = {"lr": saved_cfg.get("lr"), "schedule_steps": schedule_steps,
                      "warmup": warmup,
                      "schedule_version": saved_cfg.get("schedule_version") or 1}
    adopted = {k: v for k, v in saved_schedule.items() if getattr(cfg, k) is None}
    if adopted:
        try:
            cfg = dataclasses.replace(cfg, **adopted)  # in one go: validated together
        except UsageError:
            pass  # with another run's schedule set: the comparison below names it
    # A field the checkpoint lacks was added later: its default is what that run used.
    saved_cfg = {**{f.name: f.default for f in dataclasses.fields(TrainConfig)}, **saved_cfg,
                 **saved_schedule}
    mine = dataclasses.asdict(cfg)
    # Else the differing TrainConfig.model names the whole model.
    same_kind = saved_cfg.get("model") == mine.get("model")
    differing = [k for k in mine if k not in RESUME_MAY_DIFFER
                 and not _same(k, saved_cfg.get(k), mine[k])
                 and not (same_kind and k in COMPARED_AS_MODEL)]
    differ = [f"TrainConfig.{k}: checkpoint {saved_cfg.get(k)!r} vs now {mine[k]!r}"
              for k in differing]
    if same_kind:
        # A model field named like a TrainConfig field listed (the MoE options) is that
        # field's difference again: listed once.
        differ += model_differences(model_cfg, saved_model,
                                    MODEL_MAY_DIFFER | frozenset(differing))
        depth = saved_model.get("n_layers")
        if isinstance(depth, int) and getattr(model_cfg, "n_layers", depth) != depth:
            differ.append(f"TrainConfig.layers={depth} builds the checkpoint's depth")
    if differ:
        raise UsageError(
            f"CheckpointConfig.resume: the checkpoint in {directory!r} belongs to a different "
            "run (" + "; ".join(differ) + "). Pass the saved run's values (only "
            + ", ".join(f"TrainConfig.{k}" for k in sorted(RESUME_MAY_DIFFER))
            + " may change), or start a new run in another CheckpointConfig.directory "
            "(with TrainConfig.init_from set to this one to start from its weights with "
            "new hyperparameters)."
        )
    step = int(meta["step"])
    if extra["data"].get("position") != step:
        raise UsageError(
            f"checkpoint in {directory!r}: data position {extra['data'].get('position')} does "
            f"not match step {step}; the checkpoint is inconsistent, resume from another step."
        )
    if steps_left and step >= cfg.steps:
        state = "finished" if step == cfg.steps else f"past TrainConfig.steps={cfg.steps}"
        raise UsageError(
            f"CheckpointConfig.resume: the run in {directory!r} is {state} (checkpoint at step "
            f"{step}); nothing is left to train. To extend it, pass a larger TrainConfig.steps "
            f"(e.g. TrainConfig.steps={step + max(1, step // 5)}): the added steps train at the "
            "schedule's final learning rate."
        )
    return cfg


