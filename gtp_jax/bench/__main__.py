"""``python -m gtp_jax.bench {overlap,parallel,quant,trace,kernels} [options]``.

``python -m gtp_jax.bench --help`` lists the subcommands; ``python -m gtp_jax.bench
SUBCOMMAND --help`` lists a subcommand's options. Each subcommand's module can also be run on
its own (``python -m gtp_jax.bench.trace``, ``python -m gtp_jax.bench.kernels``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand -> (module under gtp_jax.bench, one-line description)
COMMANDS = {
    "overlap": ("overlap", "training step of a decoder, side by side: compute only, replicated "
                "weights, XLA automatic FSDP, gtp_jax with and without prefetch, PyTorch FSDP2"),
    "parallel": ("parallel", "tensor + sequence parallelism, ring collective matmuls, GTP and "
                 "MoE side by side; --micro times the collective matmul alone"),
    "quant": ("quant", "fp8 / mxfp8 / nvfp4 quantize and amax kernels (Pallas) against XLA, "
              "as bandwidth and %% of the device copy"),
    "trace": ("trace", "hidden and exposed communication per stream, read from a "
              "jax.profiler trace"),
    "kernels": ("kernels", "kernel time per training step by category from a JAX or PyTorch "
                "profiler trace"),
    "matrix": ("matrix", "the 1b step on every path a user takes (scanned/unrolled loop, "
               "prefetch, remat, gather format, the CLI, a user's own model), flagged "
               "against the best cell of its group"),
    "fp8": ("fp8", "FP8 compute against bf16: Llama-3-8B-shaped blocks and a GEMM size sweep, "
            "with the count of cuBLASLt FP8 GEMMs in each compiled program"),
    "breakdown": ("breakdown", "where one step's time and memory go (trace and buffer "
                  "assignment), gtp_jax and the PyTorch FSDP2 peer side by side"),
    "memory": ("memory", "a training step's compiled peak memory by category, from XLA's "
               "buffer assignment"),
    "context": ("context", "context parallelism: cp = 1 vs cp = N at long sequences (step time, "
                "memory, the ring's hidden communication, the longest trainable sequence)"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gtp_jax.bench",
        description="gtp_jax benchmarks. Run `python -m gtp_jax.bench SUBCOMMAND --help` for "
                    "a subcommand's options; the GPU scripts that produced the published "
                    "results are in benchmarks/ (benchmarks/README.md).", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", title="subcommands")
    for name, (_, text) in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False, allow_abbrev=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        parser = _parser()
        if argv and argv[0] in ("-h", "--help"):
            parser.print_help()
            return 0
        parser.print_usage(sys.stderr)
        got = f"unknown subcommand {argv[0]!r}" if argv else "a subcommand is required"
        print(f"python -m gtp_jax.bench: error: {got}; choose from {', '.join(COMMANDS)} "
              "(--help describes them)", file=sys.stderr)
        return 2
    module = importlib.import_module(f"gtp_jax.bench.{COMMANDS[argv[0]][0]}")
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
