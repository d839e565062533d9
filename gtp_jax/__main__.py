"""Command line: ``python -m gtp_jax train [options]``.

On a machine without accelerators the mesh is simulated with
``--xla_force_host_platform_device_count`` (set here, before JAX is imported); on a GPU
host the same command uses the GPUs.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

DEFAULT_CPU_MESH = {"dp": 2, "gtp": 4, "tp": 1, "ep": 1}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gtp_jax",
        description="gtp_jax: Generalized Tensor Parallelism for JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="train a preset transformer with GTP on the bundled byte corpus",
        description=(
            "Train a preset decoder on the bundled ~300 KB text corpus (byte tokens) with "
            "every weight, gradient and optimizer state sharded 1/gtp over the 'gtp' mesh "
            "axis. Without GPUs the mesh is simulated on CPU (default dp=2 x gtp=4 = 8 "
            "devices); with GPUs the default is gtp = number of GPUs."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    train.add_argument("--preset", default="tiny",
                       help="model size: tiny (0.8M), small (23M), 100m, 1b")
    train.add_argument("--steps", type=int, default=100, help="optimizer steps")
    train.add_argument("--batch", type=int, default=16,
                       help="global batch size in sequences (divisible by dp*ep*gtp)")
    train.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    train.add_argument("--dp", type=int, default=None, help="data-parallel size")
    train.add_argument("--gtp", type=int, default=None, help="GTP (weight-sharding) size")
    train.add_argument("--tp", type=int, default=None, help="tensor-parallel size (must be 1)")
    train.add_argument("--ep", type=int, default=None, help="expert-parallel size")
    train.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    train.add_argument("--warmup", type=int, default=10, help="warm-up steps")
    train.add_argument("--seed", type=int, default=0, help="init and data-order seed")
    train.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                       help="compute dtype (master weights stay float32)")
    train.add_argument("--gather-dtype", choices=("float32", "bfloat16"), default=None,
                       help="dtype weights are all-gathered in (default: parameter dtype)")
    train.add_argument("--pad-for-alignment", type=int, default=0,
                       help="pad sharded dims to a multiple of gtp * this (0: divisibility)")
    train.add_argument("--remat", choices=("none", "dots", "full"), default="none",
                       help="activation recompute inside each layer")
    return parser


def _mesh_sizes(args: argparse.Namespace) -> dict[str, int | None]:
    return {"dp": args.dp, "gtp": args.gtp, "tp": args.tp, "ep": args.ep}


def _simulate_cpu_devices(count: int) -> None:
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    sizes = _mesh_sizes(args)
    cpu_sizes = {k: (v if v is not None else DEFAULT_CPU_MESH[k]) for k, v in sizes.items()}
    _simulate_cpu_devices(math.prod(cpu_sizes.values()))

    import jax  # noqa: PLC0415  (XLA_FLAGS must be set before JAX starts)

    from gtp_jax.train import TrainConfig, train  # noqa: PLC0415

    if jax.default_backend() == "cpu" or any(v is not None for v in sizes.values()):
        mesh = cpu_sizes
    else:
        mesh = {"dp": 1, "gtp": jax.device_count(), "tp": 1, "ep": 1}
    if mesh["tp"] != 1:
        print("error: --tp > 1 (Megatron tensor parallelism) is not supported yet; use --tp 1.",
              file=sys.stderr)
        return 2
    try:
        cfg = TrainConfig(preset=args.preset, steps=args.steps, batch_size=args.batch,
                          seq_len=args.seq, lr=args.lr, warmup=args.warmup, seed=args.seed,
                          dtype=args.dtype, gather_dtype=args.gather_dtype,
                          pad_for_alignment=args.pad_for_alignment, remat=args.remat, **mesh)
        print(f"gtp_jax train: preset={cfg.preset} steps={cfg.steps} batch={cfg.batch_size} "
              f"seq={cfg.seq_len} mesh dp={cfg.dp} ep={cfg.ep} gtp={cfg.gtp} tp={cfg.tp} on "
              f"{jax.device_count()} {jax.default_backend()} devices", flush=True)
        result = train(cfg)
    except (ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(result.summary(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
