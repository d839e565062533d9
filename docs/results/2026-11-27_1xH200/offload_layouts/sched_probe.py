"""Where the offloaded step's host copies sit in XLA's schedule (ENTRY order)."""
import re, sys, functools, os
import jax, jax.numpy as jnp, numpy as np, optax
from gtp_jax.models import lm_loss
from gtp_jax.train import TrainConfig
from gtp_jax.train.loop import build_model_and_optimizer
from gtp_jax.train.step import TrainStep

def pattern(txt):
    entry = txt.split("\nENTRY")[-1]
    seq, names = [], {}
    for line in entry.splitlines():
        m = re.match(r"\s*(?:ROOT )?(\S+) = (.*?) (copy-start|copy-done|fusion|custom-call)\((.*)", line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        if op == "copy-start":
            first = shape.split(",")[0] if shape.startswith("(") else shape
            d = "O" if "S(5)" in shape.split("}")[0] else "I"
            names[name.lstrip("%")] = d
            seq.append(d)
        elif op == "copy-done":
            src = re.findall(r"%?(copy-start[\w.-]*)", rest)
            seq.append(names.get(src[-1] if src else "", "?").lower())
        else:
            seq.append("f")
    s = "".join(seq)
    s = re.sub(r"f{2,}", lambda m: f"[{len(m.group())}f]", s)
    inflight, both, maxin = set(), 0, 0
    cnt = {"I": 0, "O": 0}
    for c in "".join(seq):
        if c in "IO": cnt[c] += 1
        elif c in "io": cnt[c.upper()] -= 1
        if cnt["I"] > 0 and cnt["O"] > 0: both += 1
        maxin = max(maxin, cnt["I"] + cnt["O"])
    return s, both, maxin

which = sys.argv[1] if len(sys.argv) > 1 else "1b"
cfg = TrainConfig(preset=which, batch_size=4, seq_len=2048, gtp=1, dp=1, steps=2,
                  offload_optimizer=True)
model, opt = build_model_and_optimizer(cfg)
step = TrainStep(model, opt, functools.partial(lm_loss, aux_weight=0.0))
tokens = np.zeros((4, 2049), np.int32)
txt = step._program.fn.lower(step.state, tokens).compile().as_text()
s, both, maxin = pattern(txt)
print(f"{which}: {s.count('I')} h2d, {s.count('O')} d2h copy-starts; positions with both directions in flight: {both}; max in flight: {maxin}")
print(s[-3000:])

from gtp_jax.sharding.offload import group_moments, init_streamed_on_host, streamable_chain, streamed_update
from jax.sharding import Mesh, NamedSharding, PartitionSpec
L, N = (16, 100_000_000) if jax.default_backend() == "gpu" else (4, 1000)
mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
dev = NamedSharding(mesh, PartitionSpec())
tx = streamable_chain(optax.identity(), optax.adam(1e-3))
p = jax.device_put(jnp.ones((L, N), jnp.float32), dev)
g = jax.device_put(jnp.ones((L, N), jnp.float32), dev)
state = group_moments(init_streamed_on_host(tx, {"w": p}, {"w": True}), {"w": p}, {"w": True}, 1)
def trainer(p, state, g):
    new_p, new_state = streamed_update(tx, {"w": g}, state, {"w": p}, {"w": True})
    return new_p["w"], new_state
txt = jax.jit(trainer, donate_argnums=(0, 1)).lower(p, state, g).compile().as_text()
s, both, maxin = pattern(txt)
print(f"microbench: {s.count('I')} h2d, {s.count('O')} d2h; both in flight at {both}; max in flight {maxin}")
print(s[:1500])
