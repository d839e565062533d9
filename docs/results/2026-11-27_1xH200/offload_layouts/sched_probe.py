"""Where the offloaded step's host copies sit in XLA's schedule (ENTRY order; as run, tidied).

I / O: a copy-start host -> device / device -> host; i / o: its copy-done; f: a fusion or
custom call (runs collapsed to [Nf])."""
import functools
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gtp_jax.models import lm_loss
from gtp_jax.sharding.offload import (
    group_moments,
    init_streamed_on_host,
    streamable_chain,
    streamed_update,
)
from gtp_jax.train import TrainConfig
from gtp_jax.train.loop import build_model_and_optimizer
from gtp_jax.train.step.train_step import TrainStep

OP = re.compile(r"\s*(?:ROOT )?(\S+) = (.*?) (copy-start|copy-done|fusion|custom-call)\((.*)")


def pattern(txt):
    seq, names = [], {}
    for line in txt.split("\nENTRY")[-1].splitlines():
        m = OP.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        if op == "copy-start":
            names[name.lstrip("%")] = "O" if "S(5)" in shape.split("}")[0] else "I"
            seq.append(names[name.lstrip("%")])
        elif op == "copy-done":
            src = re.findall(r"%?(copy-start[\w.-]*)", rest)
            seq.append(names.get(src[-1] if src else "", "?").lower())
        else:
            seq.append("f")
    both, most, cnt = 0, 0, {"I": 0, "O": 0}
    for c in seq:
        if c in "IO":
            cnt[c] += 1
        elif c in "io":
            cnt[c.upper()] -= 1
        both += cnt["I"] > 0 and cnt["O"] > 0
        most = max(most, cnt["I"] + cnt["O"])
    return re.sub(r"f{2,}", lambda m: f"[{len(m.group())}f]", "".join(seq)), both, most


def report(label, txt, tail=True):
    s, both, most = pattern(txt)
    print(f"{label}: {s.count('I')} h2d, {s.count('O')} d2h copy-starts; positions with "
          f"both directions in flight: {both}; max in flight: {most}")
    print(s[-3000:] if tail else s[:1500])


which = sys.argv[1] if len(sys.argv) > 1 else "1b"
cfg = TrainConfig(preset=which, batch_size=4, seq_len=2048, gtp=1, dp=1, steps=2,
                  offload_optimizer=True)
model, opt = build_model_and_optimizer(cfg)
step = TrainStep(model, opt, functools.partial(lm_loss, aux_weight=0.0))
tokens = np.zeros((4, 2049), np.int32)
report(which, step._program.fn.lower(step.state, tokens).compile().as_text())

L, N = (16, 100_000_000) if jax.default_backend() == "gpu" else (4, 1000)
dev = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("x",)), PartitionSpec())
tx = streamable_chain(optax.identity(), optax.adam(1e-3))
p = jax.device_put(jnp.ones((L, N), jnp.float32), dev)
g = jax.device_put(jnp.ones((L, N), jnp.float32), dev)
state = group_moments(init_streamed_on_host(tx, {"w": p}, {"w": True}), {"w": p}, {"w": True}, 1)


def trainer(p, state, g):
    new_p, new_state = streamed_update(tx, {"w": g}, state, {"w": p}, {"w": True})
    return new_p["w"], new_state


report("microbench", jax.jit(trainer, donate_argnums=(0, 1)).lower(p, state, g).compile()
       .as_text(), tail=False)
