"""The command line (`python -m gtp_jax train`) and its job files."""
