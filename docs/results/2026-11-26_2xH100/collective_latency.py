"""What a small collective costs inside one program, by kind and by the op between links.

The planner's calibration (`gtp_jax.plan.timing.measure`) times a chain of 9 dependent
small collectives against a single one; this prints that chain for 1, 5, 9 and 17 links
and for each kind (all-gather cut back with a slice, reduce-scatter refilled with a tile
or with a broadcast, all-reduce), so a per-collective latency that looks off can be told
from an artifact of the chain's glue. Also prints the calibration itself.

Usage (all GPUs of the host; on a CPU it runs over 8 simulated devices to check itself):

    python docs/results/2026-11-26_2xH100/collective_latency.py [--elems 1024]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

if "--cpu" in sys.argv:  # before JAX starts
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def _seconds(fn, x, repeats=20):
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def chain(kind: str, links: int, count: int, elems: int):
    """`links` dependent collectives of `kind` on a per-device float32 vector (ag_slice and
    rs_tile are the calibration's own chains)."""
    from gtp_jax.plan.timing import _all_gather_chain, _reduce_scatter_chain

    if kind == "ag_slice":
        return functools.partial(_all_gather_chain, links=links)
    if kind == "rs_tile":
        return functools.partial(_reduce_scatter_chain, links=links, count=count)

    def body(x):
        for i in range(links):
            if kind == "rs_broadcast":
                x = jax.lax.psum_scatter(x, "x", tiled=True)
                if i < links - 1:
                    x = jnp.broadcast_to(x * 1.0001, (count, elems)).reshape(-1)
            else:  # "ar"
                x = jax.lax.psum(x, "x") * 0.5
        return x
    return body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elems", type=int, default=1024, help="float32 per device")
    parser.add_argument("--cpu", action="store_true", help="8 simulated CPU devices")
    args = parser.parse_args()
    devices = np.array(jax.devices())
    count = devices.size
    mesh = jax.sharding.Mesh(devices, ("x",))
    sharded = NamedSharding(mesh, P("x"))
    print(f"{count} x {devices[0].device_kind}, jax {jax.__version__}, {args.elems} float32 "
          "per device")
    print(f"{'kind':<14}" + "".join(f"{f'{n} links us':>14}" for n in (1, 5, 9, 17))
          + f"{'us per link':>14}")
    for kind in ("ag_slice", "rs_tile", "rs_broadcast", "ar"):
        per_device = count * args.elems if kind.startswith("rs") else args.elems
        x = jax.device_put(jnp.ones((count * per_device,), jnp.float32), sharded)
        times = {}
        for links in (1, 5, 9, 17):
            fn = jax.jit(jax.shard_map(chain(kind, links, count, args.elems), mesh=mesh,
                                       in_specs=P("x"), out_specs=P("x")))
            times[links] = _seconds(fn, x)
        slope = np.polyfit(list(times), list(times.values()), 1)[0]
        print(f"{kind:<14}" + "".join(f"{t * 1e6:14.1f}" for t in times.values())
              + f"{slope * 1e6:14.1f}")
    from gtp_jax.plan.timing import measure  # noqa: PLC0415

    cal = measure("bfloat16" if jax.default_backend() == "gpu" else "float32")
    print("calibration:", {k: (f"{v:.4g}" if isinstance(v, float) else v)
                           for k, v in cal.to_json().items()})


if __name__ == "__main__":
    main()
