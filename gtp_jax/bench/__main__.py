"""``python -m gtp_jax.bench {overlap,quant,parallel} [options]``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = ("overlap", "quant", "parallel")
    if not argv or argv[0] not in commands:
        print(f"usage: python -m gtp_jax.bench {{{','.join(commands)}}} [options]",
              file=sys.stderr)
        return 2
    if argv[0] == "parallel":
        from gtp_jax.bench import parallel  # noqa: PLC0415

        return parallel.main(argv[1:])
    if argv[0] == "quant":
        from gtp_jax.bench import quant  # noqa: PLC0415

        return quant.main(argv[1:])
    from gtp_jax.bench import overlap  # noqa: PLC0415

    return overlap.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
