"""Benchmarks: ``python -m gtp_jax.bench overlap``."""
