"""Smoke test of the context-parallelism benchmark (`gtp_jax.bench.context`) on the CPU mesh:
one step of the tiny preset per configuration, finite loss; no timing assertions."""

from __future__ import annotations

import json
import math

import pytest

from gtp_jax.bench import context as bench

pytestmark = pytest.mark.slow  # a minute on 2 cores (subprocesses): `-m "not slow"` skips it


def test_parse_mesh() -> None:
    assert bench.parse_mesh("gtp=2,cp=4") == {"gtp": 2, "cp": 4}
    assert bench.mesh_label({"gtp": 2, "cp": 4, "dp": 1}) == "gtp2xcp4"
    with pytest.raises(Exception, match="axis=size"):
        bench.parse_mesh("sp=2")


@pytest.mark.parametrize("mesh", ["gtp=2,cp=4", "gtp=8"])
def test_worker_one_step_finite_loss(mesh, capsys) -> None:
    assert bench.main(["--worker-mesh", mesh, "--worker-seq", "24", "--preset", "tiny",
                       "--layers", "1", "--steps", "1", "--warmup", "1"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert math.isfinite(result["loss"]) and result["seq"] == 24
    assert result["cp"] == (4 if "cp" in mesh else 1)
    assert result["batch"] == (2 if "cp" in mesh else 8)
    assert result["step_ms"] > 0 and result["tokens_per_s"] > 0
    assert 0 < result["compile_s"] < result["first_step_s"]
    assert "| gtp" in bench.format_table([result])


def test_search_in_a_subprocess(tmp_path) -> None:
    out = tmp_path / "out.json"
    assert bench.main(["--preset", "tiny", "--layers", "1", "--mesh", "cp=8", "--seqs", "",
                       "--search", "--search-start", "32", "--search-max", "32",
                       "--json", str(out)]) == 0
    longest = json.loads(out.read_text())["longest"]
    assert longest[0]["longest_seq"] == 32
    assert [(t["seq"], t["ok"]) for t in longest[0]["tries"]] == [(32, True)]


def test_search_doubles_until_a_try_fails(monkeypatch) -> None:
    # The search's own logic, with each try's subprocess replaced by a fit rule.
    def spawn(args, sizes, seq, steps, warmup):
        return ({"peak_mem_gib": seq / 1024}, "") if seq <= 64 else (None, "oom: ...")

    monkeypatch.setattr(bench, "_spawn", spawn)
    args = bench.build_parser().parse_args(["--search-max", "1024"])
    found = bench.longest_sequence(args, {"cp": 8}, 16)
    assert found["longest_seq"] == 64
    assert [(t["seq"], t["ok"]) for t in found["tries"]] == [
        (16, True), (32, True), (64, True), (128, False)]
    assert found["tries"][-1]["why"].startswith("oom")
