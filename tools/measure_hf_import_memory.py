"""Peak host memory of `gtp_jax.models.from_hf` on a mesh, against the model's size.

Writes a random built-in model of about 1.2 GB (float32, GQA, 16 layers) as a Hugging Face
checkpoint with `to_hf` (in a child process), then imports it in a fresh child process onto
8 simulated CPU devices (gtp=8: every weight stored once, 1/8 per device) and reports that
process's peak resident memory (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) before and
after the import. On CPU the
devices' buffers are host memory too, so the placed weights themselves count once (the
model's size); the rest is what the import needs on top of them.

    python tools/measure_hf_import_memory.py [DIR]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

WRITE = """
import jax.numpy as jnp, sys
from flax import nnx
from gtp_jax.models import Transformer, preset, to_hf
cfg = preset("tiny", vocab_size=32000, d_model=1024, n_heads=16, n_kv_heads=4, n_layers=16,
             d_ff=4096)
to_hf(Transformer(cfg, rngs=nnx.Rngs(0)), sys.argv[1], max_shard_bytes=512 * 2**20)
print(cfg.num_params())
"""

READ = """
import os, resource, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, gtp_jax
from gtp_jax.models import from_hf
mesh = gtp_jax.make_mesh(gtp=8)
jax.numpy.zeros(1).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model = from_hf(sys.argv[1], mesh=mesh)
jax.block_until_ready(jax.tree.leaves(__import__("flax").nnx.state(model)))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(before * 1024, after * 1024)
"""


def main() -> None:
    directory = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    params = int(subprocess.check_output([sys.executable, "-c", WRITE, directory]).split()[-1])
    before, after = map(int, subprocess.check_output(
        [sys.executable, "-c", READ, directory]).split()[-2:])
    size = params * 4
    print(f"model {params / 1e6:.0f}M params = {size / 2**20:.0f} MiB float32 in "
          f"{sum(f.endswith('.safetensors') for f in os.listdir(directory))} files; "
          f"import peak RSS {after / 2**20:.0f} MiB (start {before / 2**20:.0f} MiB): "
          f"+{(after - before) / 2**20:.0f} MiB = {(after - before) / size:.2f}x the model "
          "(the placed weights, in host memory on CPU devices, included)")


if __name__ == "__main__":
    main()
