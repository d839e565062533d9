"""Your own model in the trainer: ``python -m gtp_jax train --model package.module:factory``
(`TrainConfig.model`).

The factory is any callable ``factory(rngs, sizes)``:

- ``rngs``: an ``nnx.Rngs`` seeded with the run's ``--seed``: derive every random value from
  it (the trainer builds the module directly in its sharded layout, `gtp_jax.shard_init`,
  which calls the factory twice and needs the same module each time);
- ``sizes``: a `ModelSizes`: the vocabulary (the tokenizer's, or 256 bytes), the sequence
  length, the compute dtype and the remat policy of the run.

It returns an ``nnx.Module`` (float32 parameters: the trainer keeps them as master weights)
and optionally a loss: ``(module, loss_fn)`` with ``loss_fn(model, tokens) -> float32
scalar``, ``tokens`` int32 ``[batch, seq_len + 1]`` (split over the data axes). Without one
the run trains `next_token_loss`: the mean cross-entropy of the module's logits for
``tokens[:, :-1]`` against ``tokens[:, 1:]``, as the bundled decoder's `lm_loss`.

`UserModel` is what a run resolves ``TrainConfig.model`` into (`gtp_jax.train.config.Run.model`
holds it where a preset run holds its `TransformerConfig`): the factory's name and sizes,
which checkpoints record, and the module built without allocating anything (`abstract`),
from which the memory check counts the parameters. docs/your_model.md has the whole
contract and what a user model cannot do.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.base.metadata import STACKED
from gtp_jax.models.cross_entropy import cross_entropy

#: ``loss_fn(model, batch) -> float32 scalar``: what a factory may return beside its module.
LossFn = Callable[[nnx.Module, Any], jax.Array]
#: ``factory(rngs, sizes) -> module | (module, loss_fn)``.
Factory = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class ModelSizes:
    """The run's sizes, handed to a model factory (``factory(rngs, sizes)``).

    Attributes:
      vocab_size: token ids are in ``[0, vocab_size)``: the tokenizer's vocabulary with
        ``--data``, else 256 (the bundled corpus's bytes). The default loss needs logits
        with at least this many entries.
      seq_len: tokens per sequence the model is called on (``--seq``): the batch is
        ``int32[batch, seq_len + 1]``, the model sees ``[batch, seq_len]``.
      dtype: the compute dtype (``jnp.float32`` or ``jnp.bfloat16``: ``--dtype``, "auto"
        resolved for the backend); keep the parameters float32 and compute in this.
      remat: the run's remat policy (``"none"``, ``"dots"`` or ``"full"``: ``--remat``,
        "auto" resolved; as a ``jax.checkpoint`` policy: `remat_policy`): apply it where
        your blocks take one (``gtp_jax.Stack(..., remat=sizes.remat_policy)``), or leave
        it; the trainer applies none itself.
    """

    vocab_size: int
    seq_len: int
    dtype: Any
    remat: str

    @property
    def remat_policy(self) -> Callable[..., bool] | None:
        """`remat` as a ``jax.checkpoint`` policy, for ``gtp_jax.Stack(..., remat=...)`` or
        ``nnx.remat(..., policy=...)``: None ("none"), save the matmul outputs ("dots":
        ``dots_with_no_batch_dims_saveable``), save nothing but the layer's input ("full":
        ``nothing_saveable``)."""
        return REMAT_POLICIES[self.remat]


#: `ModelSizes.remat` -> the ``jax.checkpoint`` policy of `ModelSizes.remat_policy`.
REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


@dataclasses.dataclass(frozen=True)
class UserModel:
    """The model of a run with `TrainConfig.model` set: the factory and its sizes.

    Attributes:
      factory: ``"package.module:factory"`` as given.
      vocab_size, seq_len, dtype, remat: the `ModelSizes` the factory gets.
    """

    factory: str
    vocab_size: int
    seq_len: int
    dtype: Any
    remat: str

    @property
    def sizes(self) -> ModelSizes:
        """What the factory is called with, beside the rngs."""
        return ModelSizes(vocab_size=self.vocab_size, seq_len=self.seq_len, dtype=self.dtype,
                          remat=self.remat)

    def build(self, rngs: nnx.Rngs) -> nnx.Module:
        """The factory's module (unsharded); its loss is `loss_fn`.

        Raises:
          UsageError / UsageTypeError: the factory cannot be imported, or returns something
            else than a module or ``(module, loss_fn)``.
        """
        return _called(self.factory, rngs, self.sizes)[0]

    def abstract(self) -> nnx.Module:
        """The module built with ``nnx.eval_shape`` (shapes and dtypes, nothing allocated);
        cached."""
        return _abstract(self)[0]

    @property
    def loss_fn(self) -> LossFn:
        """The factory's loss, or `next_token_loss` for this vocabulary."""
        loss = _abstract(self)[1]
        return loss if loss is not None else functools.partial(
            next_token_loss, vocab_size=self.vocab_size)

    @property
    def default_loss(self) -> bool:
        """Whether the run trains `next_token_loss` (the factory returned no loss)."""
        return _abstract(self)[1] is None

    def param_shapes(self) -> tuple[tuple[str, tuple[int, ...], Any, bool], ...]:
        """(``/``-joined path, shape, dtype, layer-stacked) of each ``nnx.Param``."""
        return tuple(("/".join(str(k) for k in path), tuple(v.get_value().shape),
                      np.dtype(v.get_value().dtype), bool(v.get_metadata().get(STACKED, False)))
                     for path, v in nnx.to_flat_state(nnx.state(self.abstract(), nnx.Param)))

    def num_params(self) -> int:
        """Parameter elements (unsharded, unpadded)."""
        return sum(int(np.prod(shape)) for _, shape, _, _ in self.param_shapes())

    @property
    def param_dtype(self) -> Any:
        """The narrowest parameter dtype (float32 when there are none): what the memory
        bound counts every parameter in, so that it stays a lower bound."""
        dtypes = [dtype for _, _, dtype, _ in self.param_shapes()]
        return min(dtypes, key=lambda d: d.itemsize) if dtypes else np.dtype(np.float32)

    def train_flops_per_token(self, seq_len: int) -> float:
        """FLOPs per trained token for MFU, estimated as 6 per parameter (forward and
        backward of every weight once; attention's score FLOPs are not counted, so the MFU
        of a model with long sequences is underestimated)."""
        del seq_len
        return 6.0 * self.num_params()

    def has_input_layout(self) -> bool:
        """Whether the module opts in to context parallelism (``gtp_input_layout``)."""
        return callable(getattr(self.abstract(), "gtp_input_layout", None))


def next_token_loss(model: nnx.Module, tokens: jax.Array, *,
                    vocab_size: int | None = None) -> jax.Array:
    """Mean next-token cross-entropy (float32) of ``tokens: int32[batch, seq + 1]``: the
    loss a `--model` run trains when its factory returns none.

    Args:
      model: called on ``tokens[:, :-1]``; returns the logits ``[batch, seq, vocab]`` (any
        floating dtype), or an object with a ``logits`` attribute (e.g. `LMOutput`).
      tokens: int32 ``[batch, seq + 1]``; position ``t + 1`` is the target of position ``t``.
      vocab_size: the token ids' range; the logits must have at least that many entries.

    Raises:
      UsageError: the model returned something else (checked when the step is traced).
    """
    out = model(tokens[:, :-1])
    logits = getattr(out, "logits", out)
    want = (*tokens[:, :-1].shape, "vocab")
    if (not hasattr(logits, "shape") or not hasattr(logits, "dtype")
            or not jnp.issubdtype(logits.dtype, jnp.floating)
            or tuple(logits.shape[:-1]) != tuple(tokens[:, :-1].shape)
            or (vocab_size is not None and logits.shape[-1] < vocab_size)):
        got = (f"{tuple(logits.shape)} {logits.dtype}"
               if hasattr(logits, "shape") and hasattr(logits, "dtype") else type(out).__name__)
        raise UsageError(
            f"next_token_loss: the model returned {got} for tokens {tuple(tokens.shape)}; the "
            f"default loss needs floating logits {want} with vocab >= {vocab_size} (the token "
            "ids' range). Return them, or return (module, loss_fn) from the factory.")
    return cross_entropy(logits, tokens[:, 1:])


def load_factory(spec: str) -> Factory:
    """The callable ``spec`` names (``"package.module:factory"``; the attribute may be
    dotted, ``"module:Class.create"``), imported as Python imports modules; a module not
    found there is looked for in the working folder too (as ``python -m`` does, which a
    console script does not).

    Raises:
      UsageError: a malformed spec, a module that cannot be found, or no such attribute.
      UsageTypeError: the attribute is not callable.
    Errors raised by the module's own code while it is imported propagate unchanged.
    """
    module_name, attr = check_spec(spec)
    try:
        module = _import(module_name)
    except ModuleNotFoundError as err:
        raise UsageError(
            f"TrainConfig.model={spec!r}: cannot import {module_name!r} ({err}); run from the "
            "folder that holds it or add that folder to PYTHONPATH.") from None
    target: Any = module
    for name in attr.split("."):
        if not hasattr(target, name):
            raise UsageError(f"TrainConfig.model={spec!r}: {module_name!r} has no {attr!r} "
                             f"(it defines {_public_names(module)}).")
        target = getattr(target, name)
    if not callable(target):
        raise UsageTypeError(f"TrainConfig.model={spec!r}: {attr!r} is a "
                             f"{type(target).__name__}, not a function "
                             "factory(rngs, sizes) -> module.")
    return target


def check_spec(spec: Any) -> tuple[str, str]:
    """``(module, attribute)`` of a ``"package.module:factory"`` spec, checked for its form
    only (nothing is imported).

    Raises:
      UsageTypeError / UsageError: not a string of that form.
    """
    if not isinstance(spec, str):
        raise UsageTypeError(f"TrainConfig.model={spec!r} must be a string "
                             "'package.module:factory'.")
    module_name, _, attr = spec.partition(":")
    names = [*module_name.split("."), *attr.split(".")]
    if not module_name or not attr or not all(n.isidentifier() for n in names):
        raise UsageError(f"TrainConfig.model={spec!r}: use 'package.module:factory' (a module "
                         "importable from the working folder or PYTHONPATH, a colon, the "
                         "function that builds the model), e.g. 'my_model:make_model'.")
    return module_name, attr


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        here = os.getcwd()
        top = name.split(".")[0]
        if err.name != top or here in sys.path or "" in sys.path:
            raise
        sys.path.append(here)  # appended: it never shadows an installed module
        return importlib.import_module(name)


def _public_names(module: Any) -> str:
    names = sorted(n for n, v in vars(module).items() if not n.startswith("_") and callable(v)
                   and getattr(v, "__module__", None) == module.__name__)
    return ", ".join(names[:8]) or "no functions"


def _called(spec: str, rngs: nnx.Rngs, sizes: ModelSizes) -> tuple[nnx.Module, LossFn | None]:
    """``factory(rngs, sizes)`` checked: ``(module, loss_fn or None)``."""
    out = load_factory(spec)(rngs, sizes)
    loss = None
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], nnx.Module):
        out, loss = out
        if not callable(loss):
            raise UsageTypeError(f"TrainConfig.model={spec!r} returned a loss "
                                 f"{type(loss).__name__}, not a function "
                                 "loss_fn(model, tokens) -> scalar.")
    if not isinstance(out, nnx.Module):
        raise UsageTypeError(f"TrainConfig.model={spec!r} returned {type(out).__name__}; a "
                             "factory returns a flax.nnx.Module, or (module, loss_fn).")
    return out, loss


@functools.cache
def _abstract(user: UserModel) -> tuple[nnx.Module, LossFn | None]:
    losses: list[LossFn | None] = []

    def build() -> nnx.Module:
        module, loss = _called(user.factory, nnx.Rngs(0), user.sizes)
        losses.append(loss)
        return module

    return nnx.eval_shape(build), losses[0]


__all__ = ["LossFn", "ModelSizes", "UserModel", "check_spec", "load_factory",
           "next_token_loss"]
