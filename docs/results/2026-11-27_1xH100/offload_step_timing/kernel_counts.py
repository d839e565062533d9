"""Per-kernel launches per step, time per step and mean time over a trace's device events.

Usage: python kernel_counts.py TRACE_DIR STEPS
"""

import collections
import sys

from gtp_jax.bench.trace import device_kernels, find_trace, load_events

KEPT_ARGS = ("memcpy_details", "bytes", "kernel_details", "long_name")

events = load_events(find_trace(sys.argv[1]))
steps = int(sys.argv[2])
for dev, evs in device_kernels(events).items():
    agg = collections.defaultdict(lambda: [0, 0.0, None])
    for e in evs:
        a = agg[e["name"][:70]]
        a[0] += 1
        a[1] += float(e.get("dur", 0)) / 1e3
        if a[2] is None:
            a[2] = {k: v for k, v in (e.get("args") or {}).items() if k in KEPT_ARGS}
    print(dev)
    for name, (n, ms, args) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:30]:
        print(f"{name:<72} n/step {n / steps:7.1f} ms/step {ms / steps:8.2f} "
              f"mean {ms / max(n, 1):7.3f} {str(args)[:160]}")
