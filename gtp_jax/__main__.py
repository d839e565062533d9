"""``python -m gtp_jax train [options]`` (`gtp_jax.train.cli.command`) and ``python -m gtp_jax
plan [options]`` (`gtp_jax.plan.cli`)."""

from __future__ import annotations

import sys

from gtp_jax.plan.cli import auto_layout
from gtp_jax.plan.cli import main as plan_main
from gtp_jax.train.cli.command import main as train_main


def main(argv: list[str] | None = None) -> int:
    """Runs the subcommand of `argv` (default ``sys.argv[1:]``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "plan":
        return plan_main(argv[1:])
    return train_main(argv, planner=auto_layout)


if __name__ == "__main__":
    raise SystemExit(main())
