"""``python -m gtp_jax train [options]``: see `gtp_jax.train.cli`."""

from gtp_jax.train.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
