"""``python -m gtp_jax.bench matrix``: the training step on every path a user takes.

Each cell runs in its own subprocess (peak memory is per cell) on all GPUs present (gtp =
number of devices), with the 1b preset, bf16 compute and bf16 gathers by default:

  grid       loop {unrolled, scanned} x prefetch {off, on} x remat {dots, full} x gather
             {bf16, fp8} in bf16 compute, and with FP8 compute (``GTPConfig(fp8_compute=
             "tensorwise")``, every projection of 2048 features or more: `FP8_MIN_FEATURES`)
             for remat dots, both loops and both gather formats: `bench overlap`'s gtp /
             gtp_prefetch variants with the library's defaults otherwise (`GTPConfig()`:
             re-gathered embedding and head, f32 gradient reduce-scatter); beside them, per
             remat, the scanned loop with ``GTPConfig(remat_gathered=False)`` as a reference
             (peer) for the default
  cli        ``python -m gtp_jax train`` with its defaults on the same model and mesh (its
             vocabulary is the corpus's 256 bytes), timed from its ``--metrics-json``
  cli_bench  the benchmark's step on the CLI's model, optimizer and settings: what the CLI
             should match (its loop, data feeding and host syncs are the difference)
  user_*     a user's own decoder (`gtp_jax.bench.user_model`: a Python loop of blocks,
             each under ``nnx.remat``): unwrapped (data parallel), wrapped with
             `gtp_jax.shard`, and XLA's automatic FSDP of the same model

The unrolled loop always gathers one layer ahead, so ``prefetch`` does not change its
program (`gtp_jax.scan_layers`): those cells are measured once and shown for both settings.

Every cell is compared with the best cell of its group: the grid cells with the same remat
policy, the CLI with its benchmark twin, the wrapped user model with the unwrapped one and
XLA's FSDP. A gtp_jax cell over `TIME_FLAG` x its group's best step time or `MEMORY_FLAG` x
its group's lowest peak memory is flagged (peers are shown, never flagged). Each row also
carries the time to its first step (``first_step_s``: the step's compile, or its read from
the persistent compilation cache, then its first run; ``compile_cache``: hit or miss).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from gtp_jax.bench.overlap import run_for_result

TIME_FLAG = 1.15
MEMORY_FLAG = 1.3
#: ``GTPConfig.fp8_min_features`` of the FP8-compute cells, pinned (not the library's
#: default) so the cells keep measuring the same layers: the 1b preset's projections are
#: 2048 wide on one side.
FP8_MIN_FEATURES = 2048
#: The CLI's vocabulary (the bundled corpus's byte tokens).
CLI_VOCAB = 256


@dataclasses.dataclass(frozen=True)
class Cell:
    """One configuration of the step.

    Attributes:
      name: unique label.
      group: cells compared with each other.
      kind: "grid", "cli", "cli_bench" or a `gtp_jax.bench.overlap.USER_VARIANTS` name.
      loop, prefetch, remat, gather: the grid's settings ("-" where not applicable).
      peer: a reference (never flagged).
      same_as: the name of the cell whose program this one runs (measured once).
      remat_gathered: `GTPConfig.remat_gathered` of a grid cell (the default True; the
        False cells are the reference the scanned loop's default must match).
      compute: "bf16" or "fp8" (`GTPConfig.fp8_compute="tensorwise"`) for a grid cell.
    """

    name: str
    group: str
    kind: str
    loop: str = "-"
    prefetch: str = "-"
    remat: str = "-"
    gather: str = "-"
    peer: bool = False
    same_as: str | None = None
    remat_gathered: bool = True
    compute: str = "bf16"


def cells() -> list[Cell]:
    """Every cell, in table order."""
    out = []
    for remat in ("dots", "full"):
        for gather in ("bf16", "fp8"):
            for loop in ("unrolled", "scanned"):
                for prefetch in ("off", "on"):
                    name = f"{loop}_{'prefetch_' if prefetch == 'on' else ''}{remat}_{gather}"
                    same = (f"unrolled_{remat}_{gather}"
                            if loop == "unrolled" and prefetch == "on" else None)
                    out.append(Cell(name, f"remat {remat}", "grid", loop, prefetch, remat,
                                    gather, same_as=same))
        # The scanned loop with the gathered weights saved instead of re-gathered: what
        # the default (re-gathering the embedding and head) must match in time and memory.
        out.append(Cell(f"scanned_{remat}_bf16_no_remat_gathered", f"remat {remat}", "grid",
                        "scanned", "off", remat, "bf16", peer=True, remat_gathered=False))
    for gather in ("bf16", "fp8"):
        for loop in ("unrolled", "scanned"):
            out.append(Cell(f"{loop}_dots_{gather}_fp8compute", "remat dots", "grid", loop,
                            "off", "dots", gather, compute="fp8"))
    out.append(Cell("cli", "cli", "cli", "default", "off", "dots", "bf16"))
    out.append(Cell("cli_bench", "cli", "cli_bench", "default", "off", "dots", "bf16",
                    peer=True))
    for variant in ("user_unwrapped", "user_gtp", "user_xla_fsdp"):
        out.append(Cell(variant, "user model", variant, remat="nnx.remat",
                        gather="bf16" if variant == "user_gtp" else "-",
                        peer=variant != "user_gtp"))
    return out


def _overlap_argv(cell: Cell, args: argparse.Namespace) -> list[str]:
    """`bench overlap` worker arguments of a grid, cli_bench or user cell."""
    argv = ["--preset", args.preset, "--seq", str(args.seq), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--per-device-batch", str(args.per_device_batch),
            "--layers", str(args.layers)]
    if cell.kind == "grid":
        variant = "gtp_prefetch" if cell.prefetch == "on" else "gtp"
        argv += ["--remat", cell.remat,
                 "--unroll-layers" if cell.loop == "unrolled" else "--no-unroll-layers",
                 "--gather-format", "fp8" if cell.gather == "fp8" else "none"]
        if not cell.remat_gathered:
            argv.append("--no-remat-gathered")
        if cell.compute == "fp8":
            argv += ["--fp8-compute", "tensorwise", "--fp8-min-features", str(FP8_MIN_FEATURES)]
    elif cell.kind == "cli_bench":
        variant = "gtp"
        argv += ["--remat", "dots", "--vocab", str(CLI_VOCAB), "--optimizer", "train"]
    else:
        variant = cell.kind
        argv += ["--user-d", str(args.user_d), "--user-blocks", str(args.user_blocks)]
    return ["--worker", variant, *argv]


def run_cell(cell: Cell, args: argparse.Namespace) -> dict | None:
    """Times one cell in a subprocess; its row (None if it failed)."""
    if cell.kind == "cli":
        return _run_cli(args)
    cmd = [sys.executable, "-X", "faulthandler", "-m", "gtp_jax.bench", "overlap",
           *_overlap_argv(cell, args)]
    if args.profile_dir and cell.name in args.profile_cells.split(","):
        cmd += ["--profile-dir", str(Path(args.profile_dir) / cell.name),
                "--profile-variants", cmd[cmd.index("--worker") + 1]]
    row = run_for_result(cell.name, cmd, args.timeout)
    if row is None:
        return None
    return {"step_ms": row["step_ms"], "peak_mem_gib": row["peak_mem_gib"],
            "device_kind": row["device_kind"], "devices": row["devices"],
            "jax": row.get("jax"), "trace": row.get("trace"),
            "first_step_s": row.get("first_step_s"), "compile_cache": row.get("compile_cache")}


def _run_cli(args: argparse.Namespace) -> dict | None:
    """``python -m gtp_jax train`` with its defaults; median of the steps after warm-up."""
    devices = _device_count()
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.json"
        cmd = [sys.executable, "-m", "gtp_jax", "train", "--preset", args.preset,
               "--seq", str(args.seq), "--batch", str(args.per_device_batch * devices),
               "--gtp", str(devices), "--dp", "1",
               "--steps", str(args.warmup + args.steps), "--metrics-json", str(metrics)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"[cli] timed out after {args.timeout:.0f} s", flush=True)
            return None
        if proc.returncode != 0 or not metrics.exists():
            print(f"[cli] failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
            return None
        data = json.loads(metrics.read_text())
    times = [s["step_time_s"] for s in data["steps"]][args.warmup:]
    summary = data["summary"]
    memory = summary.get("memory_per_device") or {}
    header = next((line for line in proc.stdout.splitlines() if "compute " in line), "")
    return {"step_ms": statistics.median(times) * 1e3,
            "peak_mem_gib": memory.get("peak_bytes_in_use", 0) / 2**30,
            "device_kind": summary["device_kind"], "devices": summary["num_devices"],
            "choices": header.removeprefix("gtp_jax train: "),
            "first_step_s": summary.get("first_step_s"),
            "compile_cache": summary.get("compile_cache")}


def _device_count() -> int:
    """Devices this host's JAX sees, asked in a subprocess (the parent must not hold them)."""
    out = subprocess.run([sys.executable, "-c", "import jax; print(jax.device_count())"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def flag_rows(rows: list[dict]) -> list[dict]:
    """Adds each row's ratios to its group's best time and memory and its flag."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("step_ms"):
            groups.setdefault(r["group"], []).append(r)
    for r in rows:
        members = groups.get(r["group"], [])
        if not r.get("step_ms") or not members:
            r.update(time_ratio=None, memory_ratio=None, flag="failed" if not r.get(
                "step_ms") else "")
            continue
        best_t = min(m["step_ms"] for m in members)
        mems = [m["peak_mem_gib"] for m in members if m["peak_mem_gib"]]
        best_m = min(mems) if mems else 0.0
        r["time_ratio"] = r["step_ms"] / best_t
        r["memory_ratio"] = r["peak_mem_gib"] / best_m if best_m else None
        flags = []
        if not r["peer"]:
            if r["time_ratio"] > TIME_FLAG:
                flags.append(f"time > {TIME_FLAG}x")
            if r["memory_ratio"] and r["memory_ratio"] > MEMORY_FLAG:
                flags.append(f"memory > {MEMORY_FLAG}x")
        r["flag"] = ", ".join(flags)
    return rows


def format_table(rows: list[dict]) -> str:
    """A markdown table of flagged rows."""
    lines = ["| cell | group | loop | prefetch | remat | gather | compute | step ms | peak GiB | "
             "time / best | memory / best | first step s | flag |", "|" + "---|" * 13]
    for r in rows:
        fmt = lambda x, f: "-" if x is None else f.format(x)  # noqa: E731
        name = r["name"] + (f" (= {r['same_as']})" if r.get("same_as") else "")
        name += " (peer)" if r["peer"] else ""
        lines.append(
            f"| {name} | {r['group']} | {r['loop']} | {r['prefetch']} | {r['remat']} | "
            f"{r['gather']} | {r.get('compute', 'bf16')} | {fmt(r.get('step_ms'), '{:.1f}')} | "
            f"{fmt(r.get('peak_mem_gib'), '{:.1f}')} | {fmt(r.get('time_ratio'), '{:.3f}x')} "
            f"| {fmt(r.get('memory_ratio'), '{:.2f}x')} | {fmt(r.get('first_step_s'), '{:.1f}')} "
            f"| {r.get('flag') or ''} |")
    cli = next((r for r in rows if r["name"] == "cli" and r.get("step_ms")), None)
    twin = next((r for r in rows if r["name"] == "cli_bench" and r.get("step_ms")), None)
    if cli and twin:
        ratio = cli["step_ms"] / twin["step_ms"]
        chose = f" (the CLI chose: {cli['choices']})" if cli.get("choices") else ""
        lines.append(f"\nCLI median step / its benchmark twin: {ratio:.3f}x{chose}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gtp_jax.bench matrix", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--preset", default="1b", help="model preset of the grid and the CLI")
    parser.add_argument("--layers", type=int, default=0, help="override the layer count")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--per-device-batch", type=int, default=4, help="sequences per device")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per cell")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per cell")
    parser.add_argument("--user-d", type=int, default=2048, help="user model width")
    parser.add_argument("--user-blocks", type=int, default=16, help="user model blocks")
    parser.add_argument("--cells", default=None,
                        help="comma-separated cell names (default: all; see --list)")
    parser.add_argument("--list", action="store_true", help="list the cells and exit")
    parser.add_argument("--timeout", type=float, default=200.0, help="seconds per cell")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    parser.add_argument("--load", nargs="+", default=None, metavar="JSON",
                        help="print the table of rows written by earlier runs (--json), "
                        "merged (a later file's row replaces an earlier one's)")
    parser.add_argument("--profile-dir", default=None, help="trace the --profile-cells here")
    parser.add_argument("--profile-cells", default="", help="comma-separated cells to trace")
    return parser


def _write_json(args: argparse.Namespace, rows: list[dict]) -> None:
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    table = cells()
    if args.list:
        print("\n".join(f"{c.name} ({c.group})" for c in table))
        return 0
    if args.load:
        merged: dict[str, dict] = {}
        for path in args.load:
            for r in json.loads(Path(path).read_text())["rows"]:
                merged[r["name"]] = r
        rows = [merged[c.name] for c in table if c.name in merged]
        print(format_table(flag_rows(rows)))
        return 0
    wanted = set(args.cells.split(",")) if args.cells else {c.name for c in table}
    unknown = wanted - {c.name for c in table}
    if unknown:
        print(f"error: --cells: unknown {sorted(unknown)}; --list shows the cells",
              file=sys.stderr)
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    by_name = {c.name: c for c in table}
    measured: dict[str, dict | None] = {}
    rows = []
    for cell in table:
        if cell.name not in wanted:
            continue
        source = by_name[cell.same_as or cell.name]
        if source.name not in measured:
            result = measured[source.name] = run_cell(source, args)
            if result:
                print(f"[{source.name}] {result['step_ms']:.1f} ms, peak "
                      f"{result['peak_mem_gib']:.1f} GiB", flush=True)
        rows.append({**dataclasses.asdict(cell), **(measured[source.name] or {})})
        if args.json:  # after every cell: a run cut short keeps what it measured
            _write_json(args, rows)
    rows = flag_rows(rows)
    first = next((r for r in rows if r.get("device_kind")), {})
    print(f"device: {first.get('device_kind', '?')} x{first.get('devices', '?')}, preset "
          f"{args.preset}, seq {args.seq}, {args.per_device_batch} sequences per device")
    print(format_table(rows))
    if args.json:
        _write_json(args, rows)
    return 0 if any(r.get("step_ms") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
