"""Leaf modules every other package may import, and that import no other gtp_jax package.

`errors` (the library's error types), `config` (`GTPConfig`), `mesh` (the device mesh and
data placement), `metadata` (Variable metadata keys that models set and the sharding layer
reads), `axes` (the model-parallel axes published to model code), `xla_flags` (defaults the
library sets before the XLA backend starts), `host` (the host's memory, within the
process's cgroup limit), `shapes` (integer shape arithmetic: `round_up`).
"""
