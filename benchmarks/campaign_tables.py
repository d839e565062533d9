"""The tables of `benchmarks/campaign.sh`'s parts, read from the JSON files they write.

    python benchmarks/campaign_tables.py KIND DIR [DIR ...]

KIND is a campaign part (``fp8_full``, ``eight``, ``scaling``, ``layers_70b``, ``rank``: the
files of every DIR are read together, so a table can join two calls' folders), ``row FILE``
(one line for a bench overlap, bench parallel or PyTorch peer JSON file) or ``reference``
(torchtitan's published figures the ``eight`` part is read against). Standard library only:
it runs where the campaign runs, before or without JAX.

The files: ``bench overlap --json`` and ``bench parallel --json`` write a list of rows (step_ms,
peak_mem_gib, mfu, first_step_s, trace = the traced communication or None);
``benchmarks/torch_fsdp2.py``'s ``RESULT`` line is one row; ``plan --json`` and ``plan
--on-paper --json`` write the ranked candidates with their predicted ``step_seconds``.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from typing import Any

#: torchtitan's published Llama 3.1 8B training throughput, tokens/s per GPU: docs/performance.md
#: of https://github.com/pytorch/torchtitan, Table 1 ("1D Parallelism (FSDP). Llama 3.1 8B
#: model. 8 GPUs. Local batch size 2, global batch size 16. Selective activation
#: checkpointing."), rows "FSDP + torch.compile" and "FSDP + torch.compile + Float8".
TORCHTITAN_8B_8X_H100 = {"bf16": 6667, "float8": 8532}
TORCHTITAN_SOURCE = (
    "torchtitan docs/performance.md, Table 1: Llama 3.1 8B, FSDP on 8x H100 (96 GB HBM2e, "
    "500 W, Grand Teton), local batch 2 x seq 8192 (its llama3_8b.toml's seq_len), selective "
    "activation checkpointing; torch 1963fc8, torchao eab345c, torchtitan 9dec370 (2024-12)")


def load(path: str) -> list[dict[str, Any]]:
    """The rows of one JSON file (a list, one object, or nothing for an empty file)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return []
    if not text.strip():
        return []
    data = json.loads(text)
    return data if isinstance(data, list) else [data]


def first(dirs: list[str], name: str) -> list[dict[str, Any]]:
    """The rows of the first DIR/name that has any."""
    for d in dirs:
        rows = load(os.path.join(d, name))
        if rows:
            return rows
    return []


def tokens_per_device_s(r: dict[str, Any]) -> float:
    """Tokens per second per device of a bench overlap / peer row (per-device batch) or a
    bench parallel row (global batch)."""
    per_device = (r["seq"] * r["per_device_batch"] if "per_device_batch" in r
                  else r["seq"] * r["batch"] / r["devices"])
    return per_device / (r["step_ms"] / 1e3)


def exposed_ms(r: dict[str, Any]) -> float | None:
    """Communication time with no compute beside it, per step, from a traced row."""
    tr = r.get("trace")
    if not tr:
        return None
    if tr.get("exposed_ms") is not None:
        return tr["exposed_ms"]
    return tr["comm_ms"] * (1 - tr["hidden_fraction"])


def fmt(x: float | None, spec: str = ".1f", unit: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def describe(r: dict[str, Any]) -> str:
    """One line for a row of any of the three kinds."""
    name = r.get("variant", "?")
    if r.get("mesh"):
        name += " " + " x ".join(f"{k}{v}" for k, v in r["mesh"].items() if v > 1)
    peak, mfu, first_s = (fmt(r.get("peak_mem_gib"), ".1f"), pct(r.get("mfu")),
                          fmt(r.get("first_step_s"), ".1f", " s"))
    return (f"{name}: {r['step_ms']:.1f} ms, {tokens_per_device_s(r):,.0f} tokens/s per "
            f"device, peak {peak} GiB, MFU {mfu}, first step {first_s}")


def planned(plan: list[dict[str, Any]], **layout: Any) -> dict[str, Any] | None:
    """The candidate of a plan --json file with these layout fields (remat dots, unrolled,
    gathers in the compute dtype, optimizer on the device unless given)."""
    want = {"dp": 1, "gtp": 1, "tp": 1, "cp": 1, "ep": 1, "remat": "dots", "loop": "unrolled",
            "gather_format": None, "offload": False, **layout}
    for c in plan[0].get("candidates", []) if plan else []:
        if all(c["layout"].get(k) == v for k, v in want.items()):
            return c
    return None


def planned_ms(plan: list[dict[str, Any]], **layout: Any) -> float | None:
    c = planned(plan, **layout)
    return None if c is None else c["step_seconds"] * 1e3


def error(pred: float | None, measured: float | None) -> str:
    return "-" if pred is None or not measured else f"{100 * (pred / measured - 1):+.1f}%"


def peer_step(dirs: list[str], shape: str) -> dict[str, Any] | None:
    """bf16 FSDP2 at SEQxMB from a breakdown or step part's file in any DIR."""
    for d in dirs:
        for row in load(os.path.join(d, f"breakdown_{shape}.json")):
            if row.get("torch_fsdp2"):
                return row["torch_fsdp2"]["step"]
        for path in sorted(glob.glob(os.path.join(d, f"step_*_{shape}_torch.json"))):
            rows = load(path)
            if rows:
                return rows[0]
    return None


def fp8_full(dirs: list[str]) -> str:
    rows: list[tuple[str, dict[str, Any]]] = []
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "fp8full_*.json"))):
            for r in load(path):
                rows.append((os.path.basename(path)[8:-5], r))
    if not rows:
        return "fp8_full: no rows"
    shape = f"{rows[0][1]['seq']}x{rows[0][1]['per_device_batch']}"
    base = peer_step(dirs, shape)
    if base and not any(name == "torch_bf16" for name, _ in rows):
        rows.append(("torch_bf16 (the breakdown / step part's row)", base))
    ref = next((r for name, r in rows if name.startswith("torch_bf16")), None)
    out = []
    for name, r in rows:
        speed = tokens_per_device_s(r)
        ratio = f"{speed / tokens_per_device_s(ref):.3f}x" if ref else "-"
        out.append([name, f"{r['step_ms']:.1f}", f"{speed:,.0f}", ratio,
                    fmt(r.get("peak_mem_gib"), ".2f"), fmt(r.get("first_step_s"), ".1f")])
    return (f"FP8 on the whole model, {shape} per device:\n" + table(
        ["row", "step ms", "tokens/s per device", "tokens/s against bf16 FSDP2", "peak GiB",
         "first step s"], out))


def eight(dirs: list[str]) -> str:
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "eight_*_*_*.json"))):
            base = os.path.basename(path)[6:-5]  # SHAPE_KINDLAYOUT_COMPUTE
            if base.endswith("_paper"):
                continue
            shape, key = base.split("_", 1)
            rows = load(path)
            if rows:
                found.setdefault(shape, {})[key] = rows[0]
    if not found:
        return "eight: no rows"
    text = []
    for shape, rows in found.items():
        plan = first(dirs, f"eight_{shape}_paper.json")
        out = []
        for key, r in rows.items():
            kind_layout, compute = key.rsplit("_", 1)
            n = r["devices"]
            if kind_layout.startswith("gtp"):
                g = int(kind_layout[3:]) or n
                layout = f"gtp{g}" if g == n else f"dp{n // g} x gtp{g}"
                peer_key = f"torch{1 if g == n else 2}_{'float8' if compute == 'fp8' else 'bf16'}"
                peer = rows.get(peer_key) or rows.get(f"torch1_{peer_key.split('_')[1]}")
                pred = planned_ms(plan, dp=n // g, gtp=g) if compute == "bf16" else None
            else:
                reps = int(kind_layout[5:])
                layout = f"FSDP2 {n}" if reps == 1 else f"HSDP {reps} x {n // reps}"
                peer, pred = None, None
            speed = tokens_per_device_s(r)
            ref = TORCHTITAN_8B_8X_H100["bf16" if compute == "bf16" else "float8"]
            ratio = f"{r['step_ms'] / peer['step_ms']:.3f}x" if peer else "-"
            out.append([layout, "FP8" if compute in ("fp8", "float8") else "bf16",
                        f"{r['step_ms']:.1f}", f"{speed:,.0f}", f"{speed / ref:.2f}x",
                        pct(r.get("mfu")), fmt(r.get("peak_mem_gib"), ".2f"),
                        fmt(r.get("first_step_s"), ".0f"), fmt(exposed_ms(r)), ratio,
                        fmt(pred)])
        preset = next(iter(rows.values()))["preset"]
        text.append(f"{preset}, {shape} per GPU:\n" + table(
            ["layout", "compute", "step ms", "tokens/s per GPU", "against torchtitan",
             "MFU (bf16 FLOPs)", "peak GiB", "first step s", "exposed comm ms (trace)",
             "step against its peer", "planner on paper ms"], out))
    text.append(reference())
    return "\n\n".join(text)


def reference() -> str:
    return ("torchtitan's published figures (reference, another GPU and shape): "
            f"{TORCHTITAN_8B_8X_H100['bf16']:,} tokens/s per GPU in bf16 (FSDP + "
            f"torch.compile), {TORCHTITAN_8B_8X_H100['float8']:,} with Float8; "
            f"{TORCHTITAN_SOURCE}.")


def scaling(dirs: list[str]) -> str:
    rows = []
    for d in dirs:
        for path in glob.glob(os.path.join(d, "scaling_*dev.json")):
            rows += load(path)
    if not rows:
        return "scaling: no rows"
    out = []
    for r in sorted(rows, key=lambda r: r["devices"]):
        tr, exp = r.get("trace"), exposed_ms(r)
        out.append([str(r["devices"]), str(r["layers"]), f"{r['step_ms']:.1f}",
                    f"{tokens_per_device_s(r):,.0f}", pct(r.get("mfu")),
                    fmt(r.get("peak_mem_gib"), ".2f"),
                    f"{tr['comm_ms']:.1f} / {100 * tr['hidden_fraction']:.0f}%" if tr else "-",
                    fmt(exp), pct(exp / r["step_ms"]) if exp is not None else "-"])
    return ("Scaling (the 1-device row with fewer layers: compare MFU):\n" + table(
        ["devices", "layers", "step ms", "tokens/s per device", "MFU", "peak GiB",
         "comm ms / hidden (trace)", "exposed comm ms", "exposed share of the step"], out))


def layers_70b(dirs: list[str]) -> str:
    preset, out = "llama3-70b", []
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "l70_tp*_gtp*.json"))):
            for r in load(path):
                plan = first(dirs, f"l70_paper_{r['layers']}.json")
                preset = plan[0]["preset"] if plan else preset
                tp, gtp = r["mesh"].get("tp", 1), r["mesh"].get("gtp", 1)
                c = planned(plan, dp=r["mesh"].get("dp", 1), gtp=gtp, tp=tp)
                pred = None if c is None else c["step_seconds"] * 1e3
                est = None if c is None else c["estimate_bytes"] / 2**30
                out.append([f"tp{tp} x gtp{gtp}" if tp > 1 else f"gtp{gtp}", str(r["layers"]),
                            f"{r['step_ms']:.1f}", fmt(pred), error(pred, r["step_ms"]),
                            fmt(r.get("peak_mem_gib"), ".2f"), fmt(est, ".2f"),
                            f"{tokens_per_device_s(r):,.0f}"])
    if not out:
        return "layers_70b: no rows"
    return (f"{preset}-shaped layers (remat dots), measured beside the planner on paper:\n"
            + table(["layout", "layers", "step ms", "planner ms", "planner error", "peak GiB",
                     "planner estimate GiB", "tokens/s per GPU"], out))


def rank(dirs: list[str]) -> str:
    host, paper = first(dirs, "plan_rank.json"), first(dirs, "plan_rank_paper.json")
    # (label, file, variant, planner layout); the plain variants, as the planner models them
    cases = [("gtp4", "tp1_gtp4.json", "tp_gtp", {"gtp": 4}),
             ("tp2 x gtp2", "tp2_gtp2.json", "tp_gtp", {"gtp": 2, "tp": 2}),
             ("tp4", "tp4_gtp1.json", "tp", {"tp": 4})]
    out = []
    for label, name, variant, layout in cases:
        row = next((r for r in first(dirs, name) if r["variant"] == variant), None)
        if row is None and label == "gtp4" and host + paper:
            # the same step (1 sequence per GPU, remat dots) as the breakdown part ran it
            seq = (host + paper)[0]["seq"]
            row = next((b["gtp_jax"]["step"] for b in first(dirs, f"breakdown_{seq}x1.json")
                        if b.get("gtp_jax")), None)
            label += " (breakdown's row)" if row else ""
        measured = row["step_ms"] if row else None
        ph, pp = planned_ms(host, **layout), planned_ms(paper, **layout)
        out.append([label, fmt(measured), fmt(ph), error(ph, measured), fmt(pp),
                    error(pp, measured)])

    def order(col: int) -> str:
        known = [(float(r[col]), r[0]) for r in out if r[col] != "-"]
        return " < ".join(name for _, name in sorted(known)) or "-"

    return ("The planner's ranking against the measured steps (tp_gtp's plain rows, remat "
            "dots):\n" + table(["layout", "measured ms", "planner (this host) ms", "error",
                                "planner on paper ms", "error"], out)
            + f"\nfastest first: measured {order(1)}; planner {order(2)}; on paper {order(4)}")


KINDS = {"fp8_full": fp8_full, "eight": eight, "scaling": scaling, "layers_70b": layers_70b,
         "rank": rank}


def main(argv: list[str]) -> int:
    if argv[:1] == ["reference"]:
        print(reference())
        return 0
    if len(argv) == 2 and argv[0] == "row":
        rows = load(argv[1])
        print(describe(rows[0]) if rows else f"{argv[1]}: no result")
        return 0
    if len(argv) < 2 or argv[0] not in KINDS:
        print(f"usage: campaign_tables.py {{{','.join(KINDS)}}} DIR [DIR ...] | row FILE | "
              "reference", file=sys.stderr)
        return 2
    print(KINDS[argv[0]](argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
