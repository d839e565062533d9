"""``python -m gtp_jax.bench quant``: quantization kernels vs XLA, side by side in one run.

Rows (one process, one device):
  copy            jitted ``x + 1`` of a large bf16 array: the device copy bandwidth
  amax            amax of 64 expert weights: Pallas multi-amax (ONE launch) vs the XLA
                  ``jnp.max(jnp.abs(x))`` loop over the same tensors
  <fmt> cast      cast-only (amax given) per format: Pallas kernel vs XLA's fusion of the
                  pure-JAX reference (mxfp8 has no amax: its cast is its quantize)
  <fmt> quantize  fused amax + cast (fp8 / nvfp4: two passes over x by construction)
Columns: median time per call, bytes moved (x read once per pass + payload + scales
written), GB/s, percent of the copy bandwidth, speed-up vs XLA. Then the all-gather payload
bytes (payload + scales + global scale) of a realistic weight vs bf16, and, with >= 2
devices, the measured all-gather time of bf16 vs each format.

``--check`` first compares the compiled kernels with the reference bit for bit (random
bf16 / f32 weights of awkward shapes plus NaN, inf, denormal and saturating values).
``--sweep`` times a few tile / warp configurations per kernel. On CPU everything runs in
the Pallas interpreter with tiny sizes (a smoke test, not a measurement).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def _timeit(fn: Callable, args: tuple, iters: int, repeats: int = 7) -> float:
    """Median seconds per call: `iters` calls queued back to back, then one sync (so the
    host dispatch overlaps the device), repeated `repeats` times."""
    import jax

    jax.block_until_ready(fn(*args))  # compile + warm up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def _count_launches(compiled_text: str) -> int:
    """Kernel-launching instructions of the ENTRY computation of compiled HLO."""
    entry = compiled_text[compiled_text.find("ENTRY"):]
    entry = entry[:entry.find("\n}")]
    ops = ("fusion(", "custom-call(", "reduce(", "scatter(", "copy(", "convert(")
    return sum(1 for line in entry.splitlines()[1:] if any(f" {op}" in line for op in ops))


def _first_mismatch(a: Any, b: Any) -> str | None:
    import numpy as np

    x = np.ascontiguousarray(np.atleast_1d(np.asarray(a))).view(np.uint8).ravel()
    y = np.ascontiguousarray(np.atleast_1d(np.asarray(b))).view(np.uint8).ravel()
    if x.shape != y.shape:
        return f"byte shape {x.shape} != {y.shape}"
    bad = np.flatnonzero(x != y)
    if bad.size == 0:
        return None
    i = int(bad[0])
    return f"{bad.size}/{x.size} bytes differ, first at byte {i}: {x[i]:#04x} vs {y[i]:#04x}"


def check_kernels(small: bool, interpret: bool) -> tuple[dict[str, str], dict[str, int]]:
    """Kernels (with their production tile sizes) vs the XLA reference AND vs the numpy
    oracle, bit for bit, on block rows gathered from several awkward shapes with NaN / inf /
    denormal / saturating values, plus the public API end to end.

    Returns:
      ({case: 'ok' | first mismatch / error}, {informational note: value}): the notes
      record how far XLA's per-tensor scale divisions are from the correctly rounded
      quotient (the kernels take the scale as given, so this is not a kernel check).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    import gtp_jax.pallas as gp
    from gtp_jax.pallas import cast_fp8, cast_mxfp8, cast_nvfp4, formats, oracle
    from gtp_jax.pallas.tensor import to_block_rows

    rng = np.random.default_rng(0)
    results: dict[str, str] = {}
    notes: dict[str, int] = {}  # informational, not pass / fail
    special = np.array([0.0, -0.0, 2.0e-39, -1.4e-38, 3.0e38, -3.0e38, np.inf, -np.inf,
                        np.nan, 256.0, 17.0, 19.0, 500.0, -500.0, 1.75, 1.99], np.float32)

    def tensor(shape, dtype, with_special=True):
        x = rng.standard_normal(shape) * np.exp2(rng.uniform(-12, 12, shape[:-1] + (1,)))
        x = x.astype(np.float32)
        if with_special:
            flat = x.reshape(-1)
            idx = rng.choice(flat.size, size=min(flat.size, 4 * special.size), replace=False)
            flat[idx] = np.resize(special, idx.size)
        return jnp.asarray(x.astype(jnp.dtype(dtype)))

    def record(name, got, expected, nan_equal=False):
        """Compares got[0](*got[1:]) with expected[0](*expected[1:]) leaf by leaf (bytes,
        or values with NaN == NaN); errors are recorded, not raised."""
        try:
            pairs = zip(jax.tree.leaves(got[0](*got[1:])),
                        jax.tree.leaves(expected[0](*expected[1:])))
            if nan_equal:
                errs = [None if np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
                        else f"{np.asarray(a)} vs {np.asarray(b)}" for a, b in pairs]
            else:
                errs = [_first_mismatch(a, b) for a, b in pairs]
            errs = [e for e in errs if e]
            results[name] = "ok" if not errs else "; ".join(errs)[:600]
        except Exception as err:  # noqa: BLE001 - report it and go on
            results[name] = f"{type(err).__name__}: {err}"[:600]

    shapes = [((7, 45), -1), ((3, 37, 5), 1), ((1,), 0), ((1000, 333), -1)]
    if not small:
        shapes.append(((64, 4096), -1))
    fp8_kernel = jax.jit(lambda x, s: cast_fp8.cast_fp8_pallas(x, s, interpret=interpret))
    mx_kernel = jax.jit(lambda r: cast_mxfp8.quantize_mxfp8_pallas(r, interpret=interpret))
    nv_kernel = jax.jit(lambda r, g: cast_nvfp4.cast_nvfp4_pallas(r, g, interpret=interpret))
    fp8_ref = jax.jit(formats.fp8_cast_reference)
    mx_ref = jax.jit(formats.mxfp8_cast_reference)
    nv_ref = jax.jit(formats.nvfp4_cast_reference)
    for dtype in (jnp.bfloat16, jnp.float32):
        name = np.dtype(dtype).name
        parts = [(tensor(s, dtype, sp), a) for s, a in shapes for sp in (False, True)]
        flat = jnp.concatenate([x.reshape(-1) for x, _ in parts])
        flat32 = np.asarray(flat, np.float32)
        amax = np.float32(np.max(np.abs(flat32[np.isfinite(flat32)])))
        amaxes = {"amax": amax, "amax/64": amax / 64, "nan": np.float32(np.nan)}
        for label, a in amaxes.items():
            sc = formats.fp8_scale(a)
            notes[f"fp8 scale {label}: xla vs numpy ulps"] = _ulps(sc, oracle.fp8_scale(a))
            record(f"fp8 kernel {name} {label} ==ref", (fp8_kernel, flat, sc),
                   (fp8_ref, flat, sc))
            record(f"fp8 kernel {name} {label} ==numpy", (fp8_kernel, flat, sc),
                   (oracle.fp8_cast, flat32, np.float32(sc)))
        rows32 = jnp.concatenate([to_block_rows(x, a, 32) for x, a in parts])
        record(f"mxfp8 kernel {name} ==ref", (mx_kernel, rows32), (mx_ref, rows32))
        record(f"mxfp8 kernel {name} ==numpy", (mx_kernel, rows32),
               (oracle.mxfp8_cast, np.asarray(rows32, np.float32)))
        rows16 = jnp.concatenate([to_block_rows(x, a, 16) for x, a in parts])
        rows16_32 = np.asarray(rows16, np.float32)
        for label, a in {**amaxes, "tiny": np.float32(1e-30), "zero": np.float32(0)}.items():
            g = formats.nvfp4_global_scale(a)
            notes[f"nvfp4 global {label}: xla vs numpy ulps"] = _ulps(
                g, oracle.nvfp4_global_scale(a))
            record(f"nvfp4 kernel {name} {label} ==ref", (nv_kernel, rows16, g),
                   (nv_ref, rows16, g))
            record(f"nvfp4 kernel {name} {label} ==numpy", (nv_kernel, rows16, g),
                   (oracle.nvfp4_cast, rows16_32, np.float32(g)))
    x = tensor((1000, 333), jnp.bfloat16)
    deq = jax.jit(gp.dequantize, static_argnums=1)

    def cast_then_decode(v, cast):
        # Decoded by the same compiled dequantize: inside one jit with the reference cast,
        # XLA:GPU may skip the fp8 rounding altogether (excess precision).
        q = cast(v)
        return q, deq(q, jnp.float32)

    for fmt in gp.FORMATS:
        kw = {} if fmt == "mxfp8" else {"amax": np.float32(100.0)}
        qp = jax.jit(functools.partial(gp.cast_only, format=fmt, interpret=interpret, **kw))
        qr = jax.jit(functools.partial(gp.cast_only, format=fmt, backend="reference", **kw))
        record(f"{fmt} cast_only+dequantize bf16[1000,333]", (cast_then_decode, x, qp),
               (cast_then_decode, x, qr))
    xs = [tensor((64, 48), jnp.bfloat16, False), tensor((5,), jnp.float32),
          tensor((33, 7), jnp.bfloat16), tensor((3, 40), jnp.float32, False),
          tensor((300, 77), jnp.float32)]
    got = jax.jit(lambda t: gp.multi_amax(t, interpret=interpret))
    # NaN payloads may differ (XLA:GPU canonicalises NaNs in bf16 -> f32 converts).
    record("multi_amax ==ref", (got, xs),
           (jax.jit(lambda t: gp.multi_amax(t, backend="reference")), xs), True)
    record("multi_amax ==numpy", (got, xs),
           (lambda t: np.array([oracle.amax(np.asarray(v, np.float32)) for v in t]), xs), True)
    return results, notes


def _ulps(a: Any, b: Any) -> int:
    """Distance in float32 ulps (0 for two NaNs)."""
    import numpy as np

    x, y = np.float32(a), np.float32(b)
    if np.isnan(x) and np.isnan(y):
        return 0
    return abs(int(x.view(np.int32)) - int(y.view(np.int32)))


def run(args: argparse.Namespace) -> dict:
    """Runs every section; a failing section is recorded under ``errors`` and the rest
    still runs. The JSON report (``--json``) is rewritten after each section."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import gtp_jax.pallas as gp
    from gtp_jax.pallas import amax as amax_mod

    on_gpu = jax.default_backend() == "gpu"
    small = args.small or not on_gpu
    interpret = not on_gpu
    iters = args.iters or (2 if small else 30)
    dev = jax.devices()[0]
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": dev.device_kind, "platform": dev.platform, "devices": jax.device_count(),
        "jax": jax.__version__, "interpret": interpret, "small": small, "rows": [],
        "errors": {},
    }
    rows = report["rows"]
    print(f"# quant bench: {dev.device_kind} x{jax.device_count()}, jax {jax.__version__}, "
          f"interpret={interpret}, small={small}", flush=True)

    def section(name: str, fn: Callable[[], None]) -> None:
        start = time.perf_counter()
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - keep measuring the other sections
            report["errors"][name] = f"{type(err).__name__}: {err}"[:2000]
            print(f"# {name} FAILED: {report['errors'][name]}", flush=True)
        print(f"# {name} done in {time.perf_counter() - start:.1f} s", flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(report, fh, indent=1)

    def add(name: str, t: float, nbytes: int, xla_t: float | None = None, **extra) -> None:
        row = {"name": name, "time_us": t * 1e6, "bytes": nbytes, "gbps": nbytes / t / 1e9,
               **extra}
        if report.get("copy_gbps"):
            row["pct_copy"] = 100 * row["gbps"] / report["copy_gbps"]
        if xla_t is not None:
            row["speedup_vs_xla"] = xla_t / t
        rows.append(row)
        print(f"  {name}: {t * 1e6:.1f} us, {row['gbps']:.1f} GB/s", flush=True)

    def check() -> None:
        results, notes = check_kernels(small, interpret)
        report["check"] = results
        report["check_notes"] = notes
        bad = {k: v for k, v in results.items() if v != "ok"}
        print(f"check: {len(results) - len(bad)}/{len(results)} cases bit-exact", flush=True)
        for k, v in bad.items():
            print(f"  MISMATCH {k}: {v}", flush=True)

    def copy() -> None:
        n = (1 << 14) if small else (1 << 29)
        best = 0.0
        for name, dtype, fn in (
                ("copy XLA x+1 bf16", jnp.bfloat16, lambda x: x + jnp.asarray(1, x.dtype)),
                ("copy XLA x+1 f32", jnp.float32, lambda x: x + jnp.asarray(1, x.dtype)),
                ("copy XLA jnp.copy bf16", jnp.bfloat16, jnp.copy),
                ("copy Pallas bf16", jnp.bfloat16,
                 functools.partial(_pallas_copy, interpret=interpret))):
            big = jnp.ones((n if dtype == jnp.bfloat16 else n // 2,), dtype)
            t = _timeit(jax.jit(fn), (big,), iters)
            best = max(best, 2 * big.nbytes / t / 1e9)
            add(name, t, 2 * big.nbytes)
            del big
        report["copy_gbps"] = best  # the best of the copies is the reference bandwidth
        for row in rows:
            row["pct_copy"] = 100 * row["gbps"] / best

    key = jax.random.key(0)
    d, f = (64, 48) if small else (2048, 1408)
    n_exp = 4 if small else args.experts
    experts = [jax.random.normal(jax.random.fold_in(key, i), (d, f) if i % 2 else (f, d),
                                 jnp.bfloat16) for i in range(n_exp)]
    exp_bytes = sum(x.nbytes for x in experts)

    def amax_rows() -> None:
        pallas_amax = jax.jit(lambda ts: gp.multi_amax(ts, interpret=interpret))
        xla_amax = jax.jit(lambda ts: jnp.stack([jnp.max(jnp.abs(x)) for x in ts]))
        t_xla = _timeit(xla_amax, (experts,), iters)
        add(f"amax {n_exp} experts XLA loop", t_xla, exp_bytes,
            launches=_count_launches(xla_amax.lower(experts).compile().as_text()))
        compile_start = time.perf_counter()
        compiled = pallas_amax.lower(experts).compile()
        report["amax_compile_s"] = time.perf_counter() - compile_start
        t_pal = _timeit(pallas_amax, (experts,), iters)
        add(f"amax {n_exp} experts Pallas", t_pal, exp_bytes, t_xla,
            launches=_count_launches(compiled.as_text()))
        report["amax_equal_xla"] = bool(np.array_equal(np.asarray(pallas_amax(experts)),
                                                       np.asarray(xla_amax(experts))))

    def amax_sweep() -> None:
        for load_bytes, steps, unroll, warps in (
                (16384, 1, 1, 4), (2048, 16, 1, 4), (2048, 16, 2, 4), (2048, 32, 4, 4),
                (4096, 16, 2, 8), (4096, 8, 2, 4), (1024, 32, 4, 2)):
            fn = jax.jit(functools.partial(
                amax_mod.multi_amax_pallas, interpret=False, tile=load_bytes // 2,
                steps=steps, unroll=unroll, num_warps=warps))
            t = _timeit(fn, (experts,), iters)
            report.setdefault("sweep", []).append(
                {"kernel": "amax", "load_bytes": load_bytes, "steps": steps, "unroll": unroll,
                 "warps": warps, "gbps": exp_bytes / t / 1e9})

    m, k = (256, 200) if small else (14336, 4096)
    w = jax.random.normal(jax.random.fold_in(key, 999), (m, k), jnp.bfloat16)
    amax = jnp.float32(jnp.max(jnp.abs(w.astype(jnp.float32))))
    report["weight_shape"] = [m, k]

    def cast_rows(fmt: str) -> None:
        from gtp_jax.pallas import cast_fp8, cast_mxfp8, cast_nvfp4, formats
        from gtp_jax.pallas.tensor import to_block_rows

        out_bytes = gp.quantize(w, fmt, interpret=interpret).nbytes
        moved = w.nbytes + out_bytes
        # 1) the kernel alone, scale given (what quantize_coalesced runs per tensor).
        if fmt == "fp8":
            kernel = functools.partial(cast_fp8.cast_fp8_pallas, interpret=interpret)
            reference, args_ = formats.fp8_cast_reference, (w, formats.fp8_scale(amax))
        elif fmt == "mxfp8":
            kernel = functools.partial(cast_mxfp8.quantize_mxfp8_pallas, interpret=interpret)
            reference, args_ = formats.mxfp8_cast_reference, (to_block_rows(w, 1, 32),)
        else:
            kernel = functools.partial(cast_nvfp4.cast_nvfp4_pallas, interpret=interpret)
            reference = formats.nvfp4_cast_reference
            args_ = (to_block_rows(w, 1, 16), formats.nvfp4_global_scale(amax))
        t_ref = _timeit(jax.jit(reference), args_, iters)
        t_pal = _timeit(jax.jit(kernel), args_, iters)
        add(f"{fmt} cast kernel, scale given: XLA ref", t_ref, moved)
        add(f"{fmt} cast kernel, scale given: Pallas", t_pal, moved, t_ref)
        # 2) the public cast_only (scale computed from the given amax, layout, leaves).
        amax_arg = () if fmt == "mxfp8" else (amax,)

        def cast(backend):
            return jax.jit(lambda x, *a: gp.cast_only(x, fmt, *a, backend=backend,
                                                      interpret=interpret))

        t_ref = _timeit(cast("reference"), (w, *amax_arg), iters)
        t_pal = _timeit(cast("pallas"), (w, *amax_arg), iters)
        label = "quantize (1 pass)" if fmt == "mxfp8" else "cast_only(amax)"
        add(f"{fmt} {label} API: XLA ref", t_ref, moved)
        add(f"{fmt} {label} API: Pallas", t_pal, moved, t_ref)
        if fmt != "mxfp8":  # 3) fused quantize: amax pass + cast pass
            def quant(backend):
                return jax.jit(lambda x: gp.quantize(x, fmt, backend=backend,
                                                     interpret=interpret))

            moved2 = 2 * w.nbytes + out_bytes
            t_ref = _timeit(quant("reference"), (w,), iters)
            t_pal = _timeit(quant("pallas"), (w,), iters)
            add(f"{fmt} quantize (amax+cast) API: XLA ref", t_ref, moved2)
            add(f"{fmt} quantize (amax+cast) API: Pallas", t_pal, moved2, t_ref)
        if args.sweep and not small:
            report.setdefault("sweep", []).extend(
                _sweep_cast(fmt, w, amax, moved, iters))

    def gather_bytes() -> None:
        gather = []
        bf16_bytes = w.size * 2
        for fmt in (None,) + gp.FORMATS:
            if fmt is None:
                entry = {"format": "bf16", "payload": bf16_bytes, "scales": 0,
                         "total": bf16_bytes}
            else:
                q = gp.quantize(w, fmt, interpret=interpret)
                entry = {"format": fmt, "payload": q.payload.nbytes,
                         "scales": q.nbytes - q.payload.nbytes, "total": q.nbytes}
            entry["reduction_vs_bf16"] = bf16_bytes / entry["total"]
            gather.append(entry)
        report["gather_bytes"] = gather

    if args.check:
        section("check", check)
    section("copy", copy)
    section("amax", amax_rows)
    if args.sweep and not small:
        section("amax sweep", amax_sweep)
    experts.clear()  # free the expert weights before the cast rows
    for fmt in gp.FORMATS:
        section(f"{fmt} casts", functools.partial(cast_rows, fmt))
    section("gather bytes", gather_bytes)
    if jax.device_count() >= 2:
        section("gather time",
                lambda: report.__setitem__("gather_time", _gather_times(w, iters, interpret)))
    return report


def _pallas_copy(x: Any, interpret: bool, tile: int = 8192) -> Any:
    """A plain Pallas (Triton) copy kernel: the bandwidth a streaming kernel can reach."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    n = x.size

    def kernel(x_ref, o_ref):
        offset = pl.program_id(0) * tile
        mask = offset + jax.lax.broadcasted_iota(jnp.int32, (tile,), 0) < n
        plgpu.store(o_ref.at[pl.ds(offset, tile)],
                    plgpu.load(x_ref.at[pl.ds(offset, tile)], mask=mask, other=0), mask=mask)

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(pl.cdiv(n, tile),), interpret=interpret,
                          compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))(x)


def _sweep_cast(fmt: str, w: Any, amax: Any, moved: int, iters: int) -> list[dict]:
    """GB/s of one cast kernel over a few tile / warp configurations (compiled only)."""
    import jax

    from gtp_jax.pallas import cast_fp8, cast_mxfp8, cast_nvfp4, formats
    from gtp_jax.pallas.tensor import to_block_rows

    out = []
    if fmt == "fp8":
        for tile, warps in ((2048, 4), (4096, 4), (4096, 8), (8192, 4), (8192, 8)):
            if True:
                fn = jax.jit(functools.partial(cast_fp8.cast_fp8_pallas, interpret=False,
                                               tile=tile, num_warps=warps))
                t = _timeit(fn, (w, formats.fp8_scale(amax)), iters)
                out.append({"kernel": fmt, "tile": tile, "warps": warps, "gbps": moved / t / 1e9})
        return out
    rows = to_block_rows(w, 1, formats.SPECS[fmt].block)
    configs = ([(128, 4, True), (256, 4, True), (256, 8, True), (512, 8, True)]
               if fmt == "mxfp8" else
               [(64, 2, True), (64, 4, True), (128, 4, True), (128, 8, True), (256, 4, True),
                (256, 8, True), (128, 4, False)])
    for r, warps, pairs in configs:
        if fmt == "mxfp8":
            fn = jax.jit(functools.partial(cast_mxfp8.quantize_mxfp8_pallas, interpret=False,
                                           rows_per_program=r, num_warps=warps))
            args = (rows,)
        else:
            fn = jax.jit(functools.partial(cast_nvfp4.cast_nvfp4_pallas, interpret=False,
                                           rows_per_program=r, num_warps=warps,
                                           bf16_pairs=pairs))
            args = (rows, formats.nvfp4_global_scale(amax))
        t = _timeit(fn, args, iters)
        entry = {"kernel": fmt, "rows": r, "warps": warps, "gbps": moved / t / 1e9}
        if fmt == "nvfp4":
            entry["bf16_pairs"] = pairs
        out.append(entry)
    return out


def _gather_times(w: Any, iters: int, interpret: bool) -> list[dict]:
    """All-gather over all devices of a weight sharded on dim 0: the bf16 shards vs the
    quantized shards' payload + block scales (`gather_quantized`; the global scale is
    replicated, not gathered). Quantizing the full weight and sharding its leaves on
    dim 0 gives exactly the per-shard quantization with a shared scale."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import gtp_jax.pallas as gp

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("gtp",))
    rows = w.shape[0] // n * n
    shard = NamedSharding(mesh, P("gtp"))
    out = []
    variants = [(None, False)] + [(f, fused) for f in gp.FORMATS for fused in (True, False)
                                  if f != "fp8" or fused]
    for fmt, fused in variants:
        if fmt is None:
            leaves = [jax.device_put(w[:rows], shard)]

            def gather(x):
                return jax.lax.all_gather(x, "gtp", axis=0, tiled=True)
        else:
            q = gp.quantize(w[:rows], fmt, interpret=interpret)
            leaves = [jax.device_put(leaf, shard) for leaf in (q.payload, q.block_scales)
                      if leaf is not None]
            local_shape = (rows // n,) + q.shape[1:]

            def gather(*parts, q=q, local_shape=local_shape, fused=fused):
                scales = parts[1] if len(parts) > 1 else None
                local = gp.QuantizedTensor(parts[0], scales, None, local_shape, q.format, q.dim)
                full = gp.gather_quantized(local, "gtp", dim=0, fused=fused)
                return full.payload, full.block_scales
        fn = jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=(P("gtp"),) * len(leaves),
                                   out_specs=P(), check_vma=False))
        t = _timeit(fn, tuple(leaves), iters)
        label = (fmt or "bf16") + ("" if fmt in (None, "fp8") else
                                   " (1 collective)" if fused else " (2 collectives)")
        out.append({"format": label, "time_us": t * 1e6,
                    "bytes": sum(leaf.nbytes for leaf in leaves)})
    return out


def format_report(report: dict) -> str:
    lines = [f"quant bench {report['date']} on {report['device']} x{report['devices']} "
             f"(jax {report['jax']}{', interpret' if report['interpret'] else ''})",
             f"copy bandwidth: {report.get('copy_gbps', 0):.1f} GB/s", "",
             "| kernel | time us | MB moved | GB/s | % copy | vs XLA | launches |",
             "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        pct = f"{r['pct_copy']:.1f}%" if "pct_copy" in r else "-"
        sp = f"{r['speedup_vs_xla']:.2f}x" if "speedup_vs_xla" in r else "-"
        lines.append(f"| {r['name']} | {r['time_us']:.1f} | {r['bytes'] / 1e6:.1f} | "
                     f"{r['gbps']:.1f} | {pct} | {sp} | {r.get('launches', '-')} |")
    shape = "x".join(map(str, report["weight_shape"]))
    lines += ["", f"all-gather bytes of one {shape} weight:",
              "| format | payload B | scales B | total B | vs bf16 |", "|---|---|---|---|---|"]
    for g in report.get("gather_bytes", []):
        lines.append(f"| {g['format']} | {g['payload']} | {g['scales']} | {g['total']} | "
                     f"{g['reduction_vs_bf16']:.2f}x smaller |")
    if report.get("gather_time"):
        lines += ["", "measured all-gather (shard_map over all devices):"]
        base = report["gather_time"][0]["time_us"]
        for g in report["gather_time"]:
            lines.append(f"  {g['format']:>24}: {g['time_us']:.1f} us for "
                         f"{g['bytes'] / 1e6:.1f} MB ({base / g['time_us']:.2f}x vs bf16)")
    if report.get("sweep"):
        lines += ["", "sweep (GB/s):"]
        for s in report["sweep"]:
            cfg = ", ".join(f"{k}={v}" for k, v in s.items() if k not in ("kernel", "gbps"))
            lines.append(f"  {s['kernel']:>6} {cfg}: {s['gbps']:.1f}")
    if "check" in report:
        bad = [k for k, v in report["check"].items() if v != "ok"]
        lines += ["", f"bit-exact check: {len(report['check']) - len(bad)}/"
                      f"{len(report['check'])} ok" + (f"; FAILED: {bad}" if bad else "")]
    notes = report.get("check_notes", {})
    if notes:
        lines.append("XLA scale divisions vs correctly rounded (ulps): "
                     + ", ".join(f"{k.split(':')[0]}={v}" for k, v in notes.items()))
    for name, err in report.get("errors", {}).items():
        lines.append(f"ERROR in {name}: {err[:300]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gtp_jax.bench quant", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--check", action="store_true",
                        help="compare kernels with the reference bit for bit first")
    parser.add_argument("--sweep", action="store_true", help="time tile / warp configs")
    parser.add_argument("--small", action="store_true",
                        help="tiny sizes (implied off-GPU, where kernels are interpreted)")
    parser.add_argument("--iters", type=int, default=0, help="calls per timing sample")
    parser.add_argument("--experts", type=int, default=64, help="tensors in the amax row")
    args = parser.parse_args(argv)
    report = run(args)
    print(format_report(report), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    bad = [k for k, v in report.get("check", {}).items() if v != "ok"]
    return 1 if bad or report.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
