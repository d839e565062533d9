"""Reads a `jax.profiler` trace and measures how much collective time compute hid, per stream.

Input: the ``perfetto_trace.json.gz`` that ``jax.profiler.trace(dir,
create_perfetto_trace=True)`` writes (Chrome trace-event JSON). On GPUs each device is a
process named ``/device:GPU:<n>`` whose threads are CUDA streams; every kernel is a complete
(``"ph": "X"``) event on its stream.

Classification: a kernel whose name matches `COMM_PATTERN` (NCCL kernels, XLA's collective
ops) is communication; every other kernel on a device stream is compute. Per device:

* ``comm_ms``: length of the union of communication intervals;
* ``compute_ms``: length of the union of compute intervals;
* ``hidden_ms``: length of (communication union) ∩ (compute union), i.e. communication time
  during which some stream was computing;
* ``exposed_ms = comm_ms - hidden_ms`` and ``hidden_fraction = hidden_ms / comm_ms``.

Usage: ``python -m gtp_jax.bench.trace TRACE.json.gz [--steps N] [--json OUT]``, or
``python -m gtp_jax.bench.trace PROFILE_DIR --each [--excerpt-dir D]`` for the per-variant
folders a benchmark's ``--profile-dir`` holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

#: Kernel / op names counted as communication.
COMM_PATTERN = re.compile(
    r"nccl|all-?gather|reduce-?scatter|all-?reduce|collective-?permute|all-?to-?all|"
    r"send|recv|ppermute", re.IGNORECASE)
# Threads that carry summaries of device work, not kernels themselves.
_SUMMARY_THREADS = re.compile(r"XLA Modules|XLA Ops|Steps|TensorFlow|Framework|Source",
                              re.IGNORECASE)
_DEVICE_PROCESS = re.compile(r"/device:(GPU|TPU):(\d+)")

Interval = tuple[float, float]


@dataclasses.dataclass(frozen=True)
class DeviceOverlap:
    """Communication/compute overlap of one device over the traced window (milliseconds)."""

    device: str
    comm_ms: float
    compute_ms: float
    hidden_ms: float
    window_ms: float
    top_comm: tuple[tuple[str, float], ...]

    @property
    def exposed_ms(self) -> float:
        return self.comm_ms - self.hidden_ms

    @property
    def hidden_fraction(self) -> float:
        return self.hidden_ms / self.comm_ms if self.comm_ms else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(exposed_ms=self.exposed_ms, hidden_fraction=self.hidden_fraction)
        return out


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, non-overlapping union of ``(start, end)`` intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals: Sequence[Interval]) -> float:
    """Total length of already-merged intervals."""
    return sum(b - a for a, b in intervals)


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Intersection of two merged interval lists (two-pointer sweep)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def load_events(path: str | Path) -> list[dict[str, Any]]:
    """Trace events of a (optionally gzipped) Chrome/Perfetto trace-event JSON file."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _device_threads(events: list[dict[str, Any]]) -> tuple[dict[Any, str],
                                                           dict[tuple[Any, Any], str]]:
    """Device process names by pid, and thread names by (pid, tid)."""
    process_names: dict[Any, str] = {}
    thread_names: dict[tuple[Any, Any], str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process_names[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            thread_names[(e["pid"], e.get("tid"))] = e["args"]["name"]
    devices = {pid: name for pid, name in process_names.items() if _DEVICE_PROCESS.search(name)}
    return devices, thread_names


def _device_events(events: list[dict[str, Any]], keep: Any) -> dict[str, list[dict[str, Any]]]:
    devices, thread_names = _device_threads(events)
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in devices or "dur" not in e:
            continue
        if keep(thread_names.get((e["pid"], e.get("tid")), "")):
            out[devices[e["pid"]]].append(e)
    return dict(out)


def device_kernels(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Kernel events (``ph == "X"`` on a device stream thread), grouped by device name."""
    return _device_events(events, lambda thread: not _SUMMARY_THREADS.search(thread))


def device_ops(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The "XLA Ops" rows of a JAX trace (one event per HLO instruction run, named after
    it, spanning its kernels), grouped by device name; empty for other traces."""
    return _device_events(events, lambda thread: thread.startswith("XLA Ops"))


def analyze_events(events: list[dict[str, Any]]) -> list[DeviceOverlap]:
    """Per-device overlap of communication with compute; empty if the trace has no devices."""
    results = []
    for device, kernels in sorted(device_kernels(events).items()):
        comm, compute = [], []
        per_name: dict[str, float] = defaultdict(float)
        for e in kernels:
            span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            if COMM_PATTERN.search(e.get("name", "")):
                comm.append(span)
                per_name[_short(e["name"])] += float(e["dur"])
            else:
                compute.append(span)
        comm_u, compute_u = union(comm), union(compute)
        spans = comm_u + compute_u
        window = (max(b for _, b in spans) - min(a for a, _ in spans)) if spans else 0.0
        top = sorted(per_name.items(), key=lambda kv: -kv[1])[:5]
        results.append(DeviceOverlap(
            device=device, comm_ms=length(comm_u) / 1e3, compute_ms=length(compute_u) / 1e3,
            hidden_ms=length(intersect(comm_u, compute_u)) / 1e3, window_ms=window / 1e3,
            top_comm=tuple((name, us / 1e3) for name, us in top)))
    return results


#: Host <-> device copies (CUPTI names them e.g. ``MemcpyH2D`` / ``Memcpy HtoD``), matched on
#: the event's name (a stream's name lists every kind of work it ran, so it says nothing).
H2D_PATTERN = re.compile(r"memcpy.*(h2d|htod|h_?to_?d|host.?to.?device)", re.IGNORECASE)
D2H_PATTERN = re.compile(r"memcpy.*(d2h|dtoh|d_?to_?h|device.?to.?host)", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class HostTransfers:
    """Host <-> device copies of one device over the traced window (milliseconds).

    ``both_ms``: both directions moving at once (the link's duplex used); ``hidden_ms``:
    some copy moving while a compute kernel (anything not a copy or collective) runs."""

    device: str
    h2d_ms: float
    d2h_ms: float
    both_ms: float
    hidden_ms: float
    compute_ms: float
    window_ms: float

    @property
    def busy_ms(self) -> float:
        """Time some host copy is moving (the union of both directions)."""
        return self.h2d_ms + self.d2h_ms - self.both_ms

    @property
    def exposed_ms(self) -> float:
        return self.busy_ms - self.hidden_ms


def host_transfers(events: list[dict[str, Any]]) -> list[HostTransfers]:
    """Per-device timing of host <-> device copies (`H2D_PATTERN`, `D2H_PATTERN`) against
    compute: how much of the link's time ran both directions, and how much compute hid.
    Empty if the trace has no devices."""
    _, thread_names = _device_threads(events)
    out = []
    for device, kernels in sorted(_device_events(events, lambda _: True).items()):
        h2d, d2h, compute = [], [], []
        for e in kernels:
            thread = thread_names.get((e.get("pid"), e.get("tid")), "")
            if _SUMMARY_THREADS.search(thread):
                continue
            span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            name = e.get("name", "")
            if H2D_PATTERN.search(name):
                h2d.append(span)
            elif D2H_PATTERN.search(name):
                d2h.append(span)
            elif not (COMM_PATTERN.search(name) or re.search(r"memcpy|memset", name, re.I)):
                compute.append(span)
        h2d_u, d2h_u, compute_u = union(h2d), union(d2h), union(compute)
        moving = union(h2d_u + d2h_u)
        spans = moving + compute_u
        window = (max(b for _, b in spans) - min(a for a, _ in spans)) if spans else 0.0
        out.append(HostTransfers(
            device=device, h2d_ms=length(h2d_u) / 1e3, d2h_ms=length(d2h_u) / 1e3,
            both_ms=length(intersect(h2d_u, d2h_u)) / 1e3,
            hidden_ms=length(intersect(moving, compute_u)) / 1e3,
            compute_ms=length(compute_u) / 1e3, window_ms=window / 1e3))
    return out


def summarize_host(results: list[HostTransfers], steps: int = 1) -> str:
    """A Markdown table of `results`, per step."""
    lines = ["| device | host->device ms/step | device->host ms/step | both at once | "
             "hidden by compute | exposed ms/step | compute ms/step |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.device} | {r.h2d_ms / steps:.2f} | {r.d2h_ms / steps:.2f} | "
                     f"{r.both_ms / steps:.2f} | {r.hidden_ms / steps:.2f} | "
                     f"{r.exposed_ms / steps:.2f} | {r.compute_ms / steps:.2f} |")
    return "\n".join(lines)


def exposed_spans(events: list[dict[str, Any]], device: int = 0, top: int = 15
                  ) -> list[tuple[float, float, str]]:
    """The `top` longest stretches of communication with no compute kernel running, on the
    `device`-th device (name order): ``(start ms from the first kernel, length ms, the
    collectives and HLO ops running then)``. Where a step's communication is exposed
    (its start, its end, a particular layer) shows what to move or prefetch."""
    kernels = sorted(device_kernels(events).items())
    if not kernels:
        return []
    name, events_d = kernels[device]
    ops = device_ops(events).get(name, [])
    comm = union((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events_d
                 if COMM_PATTERN.search(e.get("name", "")))
    compute = union((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events_d
                    if not COMM_PATTERN.search(e.get("name", "")))
    t0 = min(float(e["ts"]) for e in events_d)
    idle = _complement(comm, compute)
    out = []
    for lo, hi in sorted(idle, key=lambda iv: iv[0] - iv[1])[:top]:
        names = {_short(e["name"]) for e in events_d + ops
                 if float(e["ts"]) < hi and float(e["ts"]) + float(e["dur"]) > lo
                 and COMM_PATTERN.search(e.get("name", ""))}
        out.append(((lo - t0) / 1e3, (hi - lo) / 1e3, ", ".join(sorted(names))[:160]))
    return out


def _complement(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The parts of merged intervals `a` not covered by merged intervals `b`."""
    out = []
    for lo, hi in a:
        cur = lo
        for blo, bhi in b:
            if bhi <= cur or blo >= hi:
                continue
            if blo > cur:
                out.append((cur, blo))
            cur = max(cur, bhi)
        if cur < hi:
            out.append((cur, hi))
    return out


def find_trace(directory: str | Path) -> Path:
    """The newest ``perfetto_trace.json.gz`` under `directory` (a `jax.profiler` log dir)."""
    found = sorted(Path(directory).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise ValueError(
            f"no perfetto_trace.json.gz under {str(directory)!r}; capture the trace with "
            "jax.profiler.trace(dir, create_perfetto_trace=True)."
        )
    return found[-1]


def trim(events: list[dict[str, Any]], max_ms: float) -> list[dict[str, Any]]:
    """Metadata plus the device-stream kernels of the first `max_ms` of device activity.

    Used to ship a small excerpt of a GPU trace with the repository.
    """
    kernels = [e for ks in device_kernels(events).values() for e in ks]
    if not kernels:
        return [e for e in events if e.get("ph") == "M"]
    t0 = min(float(e["ts"]) for e in kernels)
    keep = [e for e in kernels if float(e["ts"]) < t0 + max_ms * 1e3]
    pids = {e["pid"] for e in keep}
    meta = [e for e in events if e.get("ph") == "M" and e.get("pid") in pids]
    return meta + keep


def _short(name: str) -> str:
    return name.split("(")[0][:60]


def summarize(results: list[DeviceOverlap], steps: int = 1) -> str:
    """A Markdown table of `results`, with times divided by `steps` (per-step numbers)."""
    lines = ["| device | comm ms/step | hidden | exposed ms/step | compute ms/step | top comm |",
             "|---|---|---|---|---|---|"]
    for r in results:
        top = ", ".join(f"{n} {t / steps:.2f}" for n, t in r.top_comm[:2])
        lines.append(f"| {r.device} | {r.comm_ms / steps:.2f} | {r.hidden_fraction * 100:.1f}% | "
                     f"{r.exposed_ms / steps:.2f} | {r.compute_ms / steps:.2f} | {top} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gtp_jax.bench.trace", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("trace", help="perfetto_trace.json.gz, or a jax.profiler log dir")
    parser.add_argument("--steps", type=int, default=1, help="steps captured in the trace")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="also write the per-device results as JSON")
    parser.add_argument("--each", action="store_true",
                        help="TRACE is a folder of profiler dirs (one per benchmark variant, "
                        "as --profile-dir writes them): summarize each")
    parser.add_argument("--excerpt-dir", default=None,
                        help="with --each: also write trace_<variant>_excerpt.json.gz here")
    parser.add_argument("--excerpt-ms", type=float, default=60.0,
                        help="device time kept in each excerpt (see `trim`)")
    parser.add_argument("--host", action="store_true",
                        help="also time host <-> device copies (optimizer offload): each "
                        "direction, both at once, hidden by compute")
    parser.add_argument("--exposed", type=int, default=0, metavar="N",
                        help="also list device 0's N longest stretches of exposed "
                        "communication, with what ran then")
    args = parser.parse_args(argv)
    if args.each:
        return _each(Path(args.trace), args.steps, args.excerpt_dir, args.excerpt_ms)
    path = Path(args.trace)
    if path.is_dir():
        path = find_trace(path)
    events = load_events(path)
    results = analyze_events(events)
    print(summarize(results, args.steps))
    if args.host:
        print()
        print(summarize_host(host_transfers(events), args.steps))
    if args.exposed:
        print("\n| starts at ms | exposed ms | communication running |\n|---|---|---|")
        for start, dur, names in exposed_spans(events, top=args.exposed):
            print(f"| {start:.2f} | {dur:.3f} | {names} |")
    if args.json:
        Path(args.json).write_text(json.dumps([r.as_dict() for r in results], indent=1))
    return 0


def _each(folder: Path, steps: int, excerpt_dir: str | None, excerpt_ms: float) -> int:
    for d in sorted(p for p in folder.iterdir() if p.is_dir()):
        try:
            events = load_events(find_trace(d))
        except ValueError as err:
            print(d.name, err)
            continue
        print(f"\n## {d.name} ({steps} steps)")
        print(summarize(analyze_events(events), steps))
        if excerpt_dir:
            with gzip.open(Path(excerpt_dir) / f"trace_{d.name}_excerpt.json.gz", "wt") as f:
                json.dump({"traceEvents": trim(events, max_ms=excerpt_ms)}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
