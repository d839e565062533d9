"""Runs `python -m gtp_jax train ARGS` printing how long each step's dispatch took and
whether its loss was ready when the dispatch returned."""
import sys
import time

import gtp_jax.train.step.train_step as st

orig = st.TrainStep.__call__


def wrapped(self, batch):
    t0 = time.perf_counter()
    m = orig(self, batch)
    t1 = time.perf_counter()
    ready = m["loss"].is_ready()
    jax_state_ready = all(x.is_ready() for x in __import__("jax").tree.leaves(self.state)
                          if hasattr(x, "is_ready"))
    print(f"DISPATCH {(t1 - t0) * 1e3:9.1f} ms loss_ready={ready} state_ready={jax_state_ready}",
          flush=True)
    return m


st.TrainStep.__call__ = wrapped
from gtp_jax.__main__ import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
