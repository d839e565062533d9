# Experiment only: with FP8_XLA=1, the FP8 matmul's amax and casts run as XLA ops (its
# "xla" backend) instead of the Pallas kernels, so XLA may fuse them into their producers.
import os

if os.environ.get("FP8_XLA") == "1":
    import gtp_jax.pallas.fp8_matmul as _m

    _orig = _m._impl

    def _impl(name, backend, interpret):
        return ("xla",) if backend is None else _orig(name, backend, interpret)

    _m._impl = _impl
