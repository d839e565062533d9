"""`gtp_jax.bench.schedule`: value lifetimes in a scheduled HLO module, by hand and compiled."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from gtp_jax.bench.schedule import (
    BufferLifetime,
    buffer_lifetimes,
    classify,
    collective_windows,
    computations,
    live_bytes,
    shape_bytes,
)

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it

HEADER = "HloModule m, is_scheduled=true, entry_computation_layout={(bf16[8,64]{1,0})->f32[]}\n\n"

# Positions in ENTRY: x 0, w 1, ag 2, pair 3, wb 4, tok 5, e0 6, neg 7, fus 8, bc 9, out 10.
ENTRY_HLO = HEADER + """\
%fused_dot (p0: bf16[8,64], p1: bf16[64,32]) -> f32[8,32] {
  %p0 = bf16[8,64]{1,0} parameter(0)
  %p1 = bf16[64,32]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.7 (x: bf16[8,64], w: f8e4m3fn[16,32]) -> (f32[8,32], bf16[8,64]) {
  %x = bf16[8,64]{1,0} parameter(0), metadata={op_name="x"}
  %w = f8e4m3fn[16,32]{1,0} parameter(1)
  %ag = f8e4m3fn[64,32]{1,0} all-gather(%w), replica_groups={{0,1,2,3}}, dimensions={0}
  %pair = (f32[4]{0}, /*index=1*/s32[2,2]{1,0}) custom-call(%x), custom_call_target="foo"
  %wb = bf16[64,32]{1,0} convert(%ag)
  %tok = token[] after-all()
  %e0 = f32[4]{0} get-tuple-element(%pair), index=0
  %neg = f32[4]{0} negate(%e0)
  %fus = f32[8,32]{1,0} fusion(%x, %wb), kind=kOutput, calls=%fused_dot
  %bc = f32[256]{0} bitcast(%fus)
  ROOT %out = (f32[8,32]{1,0}, bf16[8,64]{1,0}) tuple(%fus, %x)
}
"""

# A while body that carries the current layer's gathered weight and gathers the next one.
LOOP_HLO = HEADER + """\
%body (carry: (s32[], f32[4,8], f32[1,8])) -> (s32[], f32[4,8], f32[1,8]) {
  %carry = (s32[], f32[4,8]{1,0}, f32[1,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%carry), index=0
  %cur = f32[4,8]{1,0} get-tuple-element(%carry), index=1
  %shard = f32[1,8]{1,0} get-tuple-element(%carry), index=2
  %held = f32[4,8]{1,0} copy(%cur)
  %next = f32[4,8]{1,0} all-gather(%shard), replica_groups={{0,1,2,3}}, dimensions={0}
  %use = f32[4,8]{1,0} add(%held, %held)
  %one = s32[] constant(1)
  %i1 = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[4,8]{1,0}, f32[1,8]{1,0}) tuple(%i1, %next, %shard)
}

%cond (c: (s32[], f32[4,8], f32[1,8])) -> pred[] {
  %c = (s32[], f32[4,8]{1,0}, f32[1,8]{1,0}) parameter(0)
  %n = s32[] get-tuple-element(%c), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%n, %three), direction=LT
}

ENTRY %main (a: (s32[], f32[4,8], f32[1,8])) -> (s32[], f32[4,8], f32[1,8]) {
  %a = (s32[], f32[4,8]{1,0}, f32[1,8]{1,0}) parameter(0)
  %async-start = (f32[1,8]{1,0}, f32[4,8]{1,0}) all-gather-start(%a), dimensions={0}
  %async-done = f32[4,8]{1,0} all-gather-done(%async-start)
  %neg = f32[4,8]{1,0} negate(%async-done)
  ROOT %w = (s32[], f32[4,8]{1,0}, f32[1,8]{1,0}) while(%a), condition=%cond, body=%body
}
"""


def _by_name(lifetimes: list[BufferLifetime]) -> dict[str, tuple]:
    return {b.name: (b.start, b.end, b.bytes, b.kind) for b in lifetimes}


def test_shape_bytes():
    assert shape_bytes("bf16[8,64]{1,0}") == 8 * 64 * 2
    assert shape_bytes("f8e4m3fn[16,32]") == shape_bytes("f8e5m2[512]") == 512
    assert shape_bytes("f8e8m0fnu[3]") == 3
    assert shape_bytes("f4e2m1fn[4,8]{1,0}") == 16
    assert shape_bytes("f4e2m1fn[3]") == 2  # 1.5 bytes, packed: rounds up
    assert shape_bytes("(f32[4]{0}, /*index=1*/(s8[3], c64[2]), pred[])") == 16 + 3 + 16 + 1
    assert shape_bytes("token[]") == 0 and shape_bytes("()") == 0
    with pytest.raises(ValueError, match="q7"):
        shape_bytes("q7[2]")


def test_hand_written_entry():
    lifetimes = buffer_lifetimes(ENTRY_HLO)
    assert _by_name(lifetimes) == {
        "x": (0, 10, 1024, "other"),         # returned by the ROOT tuple
        "w": (0, 2, 512, "other"),           # f8: 1 byte
        "ag": (2, 4, 2048, "all-gather"),
        "pair{0}": (3, 7, 16, "other"),      # used through get-tuple-element by neg
        "pair{1}": (3, 3, 16, "other"),      # never used
        "wb": (4, 8, 4096, "other"),
        "neg": (7, 7, 16, "other"),
        "fus": (8, 10, 1024, "dot"),         # fusion of a dot; returned by the ROOT
    }  # no token, no bitcast/get-tuple-element/tuple values
    assert [b.name for b in lifetimes] == ["x", "w", "ag", "pair{0}", "pair{1}", "wb", "neg",
                                           "fus"]
    assert lifetimes[0].shape == "bf16[8,64]" and lifetimes[0].opcode == "parameter"
    assert live_bytes(lifetimes) == [1536, 1536, 3584, 3104, 7184, 5136, 5136, 5152, 6144,
                                     2048, 2048]
    big = buffer_lifetimes(ENTRY_HLO, min_bytes=1024)
    assert [b.name for b in big] == ["x", "ag", "wb", "fus"]
    assert live_bytes([]) == []


def test_hand_written_loop_body_and_async():
    body = buffer_lifetimes(LOOP_HLO, "body")
    assert _by_name(body) == {
        "carry{0}": (0, 8, 4, "other"),
        "carry{1}": (0, 4, 128, "other"),
        "carry{2}": (0, 9, 32, "other"),     # passed on to the ROOT
        "held": (4, 6, 128, "other"),
        "next": (5, 9, 128, "all-gather"),
        "use": (6, 6, 128, "other"),
        "one": (7, 8, 4, "other"),
        "i1": (8, 9, 4, "other"),
    }
    origin = {b.name: b.origin for b in body}
    # The carried weight is what the previous iteration gathered; `held` is its copy.
    assert origin["carry{1}"] == origin["held"] == origin["next"] == "all-gather"
    assert origin["carry{2}"] == origin["use"] == origin["carry{0}"] == "other"
    # Async all-gather: the start's element 0 is its operand, which lives until the done.
    entry = _by_name(buffer_lifetimes(LOOP_HLO))
    assert entry == {"a{0}": (0, 4, 4, "other"), "a{1}": (0, 4, 128, "other"),
                     "a{2}": (0, 4, 32, "other"), "async-start{1}": (1, 3, 128, "all-gather"),
                     "neg": (3, 3, 128, "other"), "w{0}": (4, 4, 4, "other"),
                     "w{1}": (4, 4, 128, "other"), "w{2}": (4, 4, 32, "other")}


def test_computations_and_classify():
    comps = computations(ENTRY_HLO)
    assert set(comps) == {"fused_dot", "main.7"}
    assert comps["main.7"].startswith("ENTRY %main.7 (")
    assert comps["main.7"].endswith("tuple(%fus, %x)")  # its last instruction
    lines = {ln.split("=")[0].strip(" %"): ln for ln in comps["main.7"].splitlines()[1:-1]}
    assert classify(lines["ag"], comps) == "all-gather"
    assert classify(lines["fus"], comps) == "dot"
    assert classify(lines["wb"], comps) is None
    assert classify("  %rs = (f32[2]{0}, f32[8]{0}) reduce-scatter-start(%p)", comps) == (
        "reduce-scatter")
    assert classify("  %d = f32[8]{0} all-gather-done(%s)", comps) is None


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"computation: 'no_such_body'.*main\.7"):
        buffer_lifetimes(ENTRY_HLO, "no_such_body")
    with pytest.raises(ValueError, match="text: .*HLO module"):
        buffer_lifetimes("module @jit_f { func.func public @main() }")
    with pytest.raises(ValueError, match="text: .*not scheduled"):
        buffer_lifetimes(ENTRY_HLO.replace("is_scheduled=true", "is_scheduled=false"))


def test_compiled_all_gather_lives_until_its_dot():
    mesh = Mesh(np.array(jax.devices()), ("x",))
    n = mesh.size

    def per_device(x, w):
        return jnp.tanh(x @ jax.lax.all_gather(w, "x", tiled=True))

    f = jax.shard_map(per_device, mesh=mesh, in_specs=(P("x"), P("x", None)),
                      out_specs=P("x"))
    x = jnp.ones((2 * n, 48), jnp.float32)
    w = jnp.ones((48, 40), jnp.float32)  # (CPU XLA gathers bf16 as f32)
    text = jax.jit(f).lower(x, w).compile().as_text()
    lifetimes = buffer_lifetimes(text)
    gathers = [b for b in lifetimes if b.kind == "all-gather"]
    assert len(gathers) == 1, lifetimes
    ag = gathers[0]
    assert ag.bytes == 48 * 40 * 4 and ag.shape == "f32[48,40]", ag  # the whole weight
    dots = [b for b in lifetimes if b.kind == "dot" and b.start > ag.start]
    assert dots, lifetimes
    assert ag.end >= dots[0].start, (ag, dots[0])
    assert live_bytes(lifetimes)[ag.start] >= ag.bytes
    # min_bytes keeps the gathered weight and drops the per-device shard.
    assert ag in buffer_lifetimes(text, min_bytes=ag.bytes)
    assert all(b.bytes >= ag.bytes for b in buffer_lifetimes(text, min_bytes=ag.bytes))


RING_HLO = """HloModule ring, is_scheduled=true

ENTRY %main (p0: f32[8,8], p1: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  %hop = (f32[8,8]{1,0}, f32[8,8]{1,0}, u32[], u32[]) collective-permute-start(%p0)
  %att = (f32[8,8]{1,0}, u8[0]{0}) custom-call(%p1, %p1), custom_call_target="__cudnn$fmhaSoftmax"
  %hop.done = f32[8,8]{1,0} collective-permute-done(%hop)
  %bare = (f32[8,8]{1,0}, f32[8,8]{1,0}, u32[], u32[]) collective-permute-start(%hop.done)
  %bare.done = f32[8,8]{1,0} collective-permute-done(%bare)
  %o = f32[8,8]{1,0} get-tuple-element(%att), index=0
  ROOT %add = f32[8,8]{1,0} add(%bare.done, %o)
}
"""


def test_ring_hops_and_attention_kernels_in_collective_windows():
    # A ring's hop is a window of its own; cuDNN's attention between its start and done
    # counts as the compute beside it, as a GEMM does.
    windows = {w.name: w for w in collective_windows(RING_HLO)}
    assert set(windows) == {"hop", "bare"}
    assert windows["hop"].kind == "collective-permute" and windows["hop"].elements == 64
    assert windows["hop"].between == 1
    assert windows["bare"].between == 0
