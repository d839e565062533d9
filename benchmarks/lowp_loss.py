"""Loss curves of GTP training with low-precision weight gathers vs the bf16/fp32 gather.

Trains the same decoder (same init, same data order) once per gather format and reports the
final loss (mean of the last 10 steps) and its gap to the full-precision gather run.

    python benchmarks/lowp_loss.py --preset tiny --steps 300            # CPU: 8 simulated devices
    python benchmarks/lowp_loss.py --preset 100m --steps 300 --seq 512   # GPU

Prints a table and writes ``--json`` (curves every 10 steps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--preset", default="tiny", help="model preset")
    parser.add_argument("--steps", type=int, default=300, help="training steps per format")
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--formats", default="none,fp8,mxfp8,nvfp4",
                        help="comma-separated gather formats (none: full precision)")
    parser.add_argument("--backend", default="pallas", choices=("pallas", "reference"),
                        help="quantize kernels: Pallas or the pure-JAX reference")
    parser.add_argument("--json", default=None, help="write the losses here")
    args = parser.parse_args(argv)
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "") and \
            os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8").strip()

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import gtp_jax
    from gtp_jax.data import VOCAB_SIZE, ByteBatcher, load_corpus
    from gtp_jax.models import Transformer, lm_loss, preset
    from gtp_jax.train import TrainStep

    on_gpu = jax.default_backend() == "gpu"
    n = jax.device_count()
    mesh = gtp_jax.make_mesh(gtp=n) if on_gpu else gtp_jax.make_mesh(dp=2, gtp=n // 2)
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    cfg = preset(args.preset, vocab_size=VOCAB_SIZE, max_seq_len=args.seq, dtype=dtype,
                 **({"remat": "dots"} if on_gpu else {}))
    corpus = load_corpus()
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, 10, args.steps, args.lr / 10)
    results = []
    for fmt in args.formats.split(","):
        gather_format = None if fmt == "none" else fmt
        model = gtp_jax.shard(
            Transformer(cfg, rngs=nnx.Rngs(0)), mesh,
            gtp_jax.GTPConfig(gather_format=gather_format, quant_backend=args.backend,
                              gather_dtype=dtype if on_gpu else None,
                              remat_gathered=not on_gpu))
        optimizer = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0),
                                                     optax.adamw(schedule, weight_decay=0.1)),
                                  wrt=nnx.Param)
        step = TrainStep(model, optimizer, lm_loss)

        batcher = ByteBatcher(corpus, batch_size=args.batch, seq_len=args.seq, seed=0)
        placement = gtp_jax.data_sharding(mesh)
        losses = []
        start = time.perf_counter()
        for _ in range(args.steps):
            losses.append(float(step(jax.device_put(batcher.next_batch(), placement))["loss"]))
        final = sum(losses[-10:]) / 10
        results.append({"format": fmt, "final_loss": final, "first_loss": losses[0],
                        "curve": losses[::10], "seconds": time.perf_counter() - start})
        print(f"[{fmt}] loss {losses[0]:.4f} -> {final:.4f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    base = results[0]["final_loss"]
    print(f"\npreset {args.preset}, {args.steps} steps, batch {args.batch} x seq {args.seq}, "
          f"{jax.devices()[0].device_kind} x{n}, mesh {dict(mesh.shape)}, jax {jax.__version__}")
    print("| gather format | final loss (mean of last 10) | gap vs " + results[0]["format"] + " |")
    print("|---|---|---|")
    for r in results:
        print(f"| {r['format']} | {r['final_loss']:.4f} | "
              f"{(r['final_loss'] - base) / base * 100:+.2f}% |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "steps": args.steps, "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
