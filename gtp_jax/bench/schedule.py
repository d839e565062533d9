"""Reads a compiled, scheduled XLA HLO module: its computations and how long each value lives.

Input: the text of ``jax.jit(f).lower(...).compile().as_text()`` (or an XLA dump "after
optimizations"). Its header says ``is_scheduled=true``, so the order of the instructions in
each computation is the order in which they run; a *position* below is the 0-based index of an
instruction in its computation. Sizes are in bytes, of one device's (per-shard) arrays.

`buffer_lifetimes` is a value-lifetime approximation, not XLA's buffer assignment: XLA may
alias an output with an input, reuse a dead buffer, or keep constants and parameters in
buffers of their own, so the live bytes here are not the peak memory XLA reports.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

_BITS = {"pred": 8, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32,
         "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128,
         "s4": 4, "u4": 4, "s2": 2, "u2": 2, "f4e2m1fn": 4, "token": 0}
_LEAF = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_INSTR = re.compile(r"\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_DEPTH = {"(": 1, "{": 1, ")": -1, "}": -1}
_RELAYOUT = {"parameter", "bitcast", "copy", "transpose", "reshape"}
_ALIASES = ("bitcast", "get-tuple-element", "tuple")  # new names for existing buffers
Tree = int | tuple | None  # record index, no buffer (token), or a tuple of trees


@dataclasses.dataclass(frozen=True)
class BufferLifetime:
    """One value of a computation, live from schedule position `start` to `end` (inclusive).

    `name`: the defining instruction, with ``{i}`` (``{i,j}``, ...) appended for an element of
    a tuple-shaped result. `kind`: `classify`'s answer, or ``"other"``. `origin`: the kind of
    the data the value holds; that is `kind`, except for a ``copy``, a fusion that only
    copies, transposes or reshapes its one operand, and an element of a while body's
    parameter: these take the origin of what they copy (the parameter element: of the ROOT
    tuple element that the next iteration receives), so a gathered weight copied into the
    loop carry still has origin ``"all-gather"``. `shape`: without layout, e.g.
    ``bf16[8,64]``. `bytes`: per device.
    """

    name: str
    opcode: str
    kind: str
    origin: str
    shape: str
    bytes: int
    start: int
    end: int


def computations(text: str) -> dict[str, str]:
    """``{name: text}`` of every computation (``ENTRY`` included) of an HLO module's text;
    each text is the computation's header line and then one line per instruction (the
    closing ``}`` is left out)."""
    comps = {}
    for c in re.split(r"\n(?=\S)", text):
        m = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)", c)
        if m and c.split("\n", 1)[0].rstrip().endswith("{"):
            comps[m.group(1)] = c
    return comps


def _parse(line: str) -> tuple[bool, str, str, str, list[str]] | None:
    """(is_root, name, shape text, opcode, operand names) of an instruction line, or None."""
    m = _INSTR.match(line)
    if not m:
        return None
    i = m.end()
    j = _close(line, i) if line.startswith("(", i) else line.find(" ", i)
    op = re.match(r"\s*([\w\-]+)\(", line[j:]) if j > 0 else None
    if not op:
        return None
    args = line[j + op.end():_close(line, j + op.end() - 1) - 1]
    args = re.sub(r"/\*.*?\*/", "", args)
    names = [a.split()[-1].lstrip("%") for a in _split_top(args) if a.strip()]
    return bool(m.group(1)), m.group(2), line[i:j], op.group(1), names


def _close(s: str, i: int) -> int:
    """Index just past the bracket that closes the one at ``s[i]``."""
    depth = 0
    for k in range(i, len(s)):
        depth += _DEPTH.get(s[k], 0)
        if depth == 0:
            return k + 1
    return len(s)


def _split_top(s: str) -> list[str]:
    """`s` split at its commas outside brackets."""
    parts, depth, last = [], 0, 0
    for k, ch in enumerate(s):
        depth += _DEPTH.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(s[last:k])
            last = k + 1
    return parts + [s[last:]]


def classify(line: str, comps: dict[str, str]) -> str | None:
    """``"all-gather"``, ``"reduce-scatter"`` (their sync op or async ``-start``), ``"dot"``
    (a dot, a GEMM custom call, or a fusion whose fused computation in `comps` holds a dot)
    or None for any other instruction line of an HLO computation."""
    parsed = _parse(line)
    if not parsed:
        return None
    op = parsed[3]
    for coll in ("all-gather", "reduce-scatter"):
        if op.startswith(coll) and not op.endswith("done"):
            return coll
    if op == "dot":
        return "dot"
    if op == "custom-call" and re.search(r'custom_call_target="[^"]*(gemm|matmul)', line):
        return "dot"  # a GPU program's cuBLAS / cuBLASLt GEMM
    if op == "fusion":  # a fusion whose fused computation holds a dot
        callee = re.search(r"calls=%?([\w.\-]+)", line)
        if callee and " dot(" in comps.get(callee.group(1), ""):
            return "dot"
    return None


def _relayout(line: str, comps: dict[str, str]) -> bool:
    """Whether a fusion line only copies, transposes or reshapes its operand."""
    callee = re.search(r"calls=%?([\w.\-]+)", line)
    body = comps.get(callee.group(1), "") if callee else ""
    ops = {p[3] for p in map(_parse, body.splitlines()[1:]) if p}
    return bool(ops) and ops <= _RELAYOUT


def _shape_tree(shape: str) -> Tree:
    """A shape's text as a tree of leaf texts without layout: ``(f32[2]{0}, s8[])`` ->
    ``("f32[2]", "s8[]")``."""
    shape = re.sub(r"\{[^{}]*\}", "", re.sub(r"/\*.*?\*/", "", shape))
    stack: list[list] = [[]]
    for tok in re.findall(r"\(|\)|[a-z][a-z0-9]*\[[^\]]*\]", shape):
        if tok == "(":
            stack.append([])
        elif tok == ")":
            stack[-2].append(tuple(stack.pop()))
        else:
            stack[-1].append(tok)
    return stack[0][0] if stack[0] else ()


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape's text, e.g. ``bf16[8,64]{1,0}`` -> 1024; a tuple is the sum of
    its elements; sub-byte types (``f4e2m1fn``, ``s4``) round up to whole bytes; token: 0."""
    total = 0
    for dtype, dims in _LEAF.findall(re.sub(r"\{[^{}]*\}", "", shape)):
        bits = 8 if dtype.startswith("f8") else _BITS.get(dtype)
        if bits is None:
            raise ValueError(f"shape: unknown element type {dtype!r} in {shape!r}")
        total += math.ceil(bits * math.prod(int(d) for d in re.findall(r"\d+", dims)) / 8)
    return total


def _leaves(tree: Tree, path: tuple = ()):
    if isinstance(tree, tuple):
        for i, t in enumerate(tree):
            yield from _leaves(t, path + (i,))
    else:
        yield path, tree


def buffer_lifetimes(text: str, computation: str | None = None,
                     min_bytes: int = 0) -> list[BufferLifetime]:
    """Lifetime of every array value defined in one computation of a scheduled HLO module.

    `text`: the module's text (see the module docstring); `computation`: a computation name,
    e.g. a while loop's ``body=``, or None for the ENTRY computation. A value starts at the
    position of its instruction (parameters: 0) and ends at its last use in the computation
    (its own position if unused; the last position if the ROOT returns it). Tuple-shaped
    results give one value per element; ``bitcast``, ``get-tuple-element`` and ``tuple``
    define no new value (their uses count for their operands' values), nor does an async
    ``-done`` (its result is its ``-start``'s output element, the start's element 0 is its
    operand). Tokens are skipped, and so are values smaller than `min_bytes`. Values in
    order of definition.
    """
    head = text.lstrip().split("\n", 1)[0] if isinstance(text, str) else ""
    if not head.startswith("HloModule"):
        raise ValueError("text: expected the text of an HLO module (starting with 'HloModule'"
                         f", e.g. compiled.as_text()), got {str(text)[:40]!r}")
    if "is_scheduled=true" not in head:
        raise ValueError("text: the HLO module is not scheduled (no is_scheduled=true); pass "
                         "the compiled module's text: jax.jit(f).lower(...).compile().as_text()")
    comps = computations(text)
    entry = re.search(r"^ENTRY\s+%?([\w.\-]+)", text, re.MULTILINE)
    name = computation if computation is not None else (entry.group(1) if entry else "ENTRY")
    if name not in comps:
        some = ", ".join(sorted(comps, key=len)[:6])
        raise ValueError(f"computation: {name!r} is not in this module; it has {len(comps)} "
                         f"computations, e.g. {some}")
    instrs = [(ln, p) for ln in comps[name].splitlines()[1:] if (p := _parse(ln))]
    recs: list[dict] = []
    trees: dict[str, Tree] = {}
    src: dict[int, int] = {}  # value -> the value it is a copy of

    def define(t: Tree | str, path: tuple, start: int, kind: str, iname: str, op: str) -> Tree:
        if isinstance(t, tuple):
            return tuple(define(e, path + (i,), start, kind, iname, op) for i, e in enumerate(t))
        if not isinstance(t, str) or t.startswith("token"):
            return t  # an aliased value, or no buffer
        suffix = "{" + ",".join(map(str, path)) + "}" if path else ""
        recs.append({"name": iname + suffix, "opcode": op, "kind": kind, "shape": t,
                     "bytes": shape_bytes(t), "start": start, "end": start})
        return len(recs) - 1

    for pos, (line, (_, iname, shape, op, args)) in enumerate(instrs):
        ops = [trees[a] for a in args if a in trees]
        if op not in _ALIASES:  # a use of every value of every operand
            for leaf in (lf for t in ops for _, lf in _leaves(t) if lf is not None):
                recs[leaf]["end"] = max(recs[leaf]["end"], pos)
        first = ops[0] if ops else None
        if op == "tuple":
            trees[iname] = tuple(ops)
        elif op in ("bitcast", "all-reduce-done") or (
                op.endswith("-done") and not isinstance(first, tuple)):
            trees[iname] = first
        elif op == "get-tuple-element":
            index = int(re.search(r"index=(\d+)", line).group(1))
            trees[iname] = first[index] if isinstance(first, tuple) else first
        elif op.endswith("-done"):  # element 1 of the -start tuple (copy-start: element 0)
            trees[iname] = first[int(op != "copy-done")]
        else:
            tree = _shape_tree(shape)
            if (op.endswith("-start") and op not in ("copy-start", "all-reduce-start")
                    and isinstance(tree, tuple) and tree and ops):  # element 0: the operands
                tree = (tuple(ops) if isinstance(tree[0], tuple) else first,) + tree[1:]
            kind = classify(line, comps) or "other"
            new = trees[iname] = define(tree, (), 0 if op == "parameter" else pos, kind,
                                        iname, op)
            if isinstance(new, int) and len(ops) == 1 and isinstance(first, int) and (
                    op == "copy" or (op == "fusion" and _relayout(line, comps))):
                src[new] = first
    root = next((p[1] for _, p in instrs if p[0]), instrs[-1][1][1] if instrs else "")
    for _, leaf in _leaves(trees.get(root)):
        if leaf is not None:
            recs[leaf]["end"] = len(instrs) - 1
    params = [p[1] for _, p in instrs if p[3] == "parameter"]
    if len(params) == 1 and re.search(rf"body=%?{re.escape(name)}(?![\w.\-])", text):
        # a while body: element i of its parameter is element i of the previous ROOT
        param = dict(_leaves(trees[params[0]]))
        for path, leaf in _leaves(trees.get(root)):
            if path and param.get(path) is not None and leaf is not None:
                src.setdefault(param[path], leaf)
    out = []
    for k, r in enumerate(recs):
        seen, j = {k}, k
        while recs[j]["kind"] == "other" and j in src and src[j] not in seen:
            j = src[j]
            seen.add(j)
        if r["bytes"] >= min_bytes:
            out.append(BufferLifetime(origin=recs[j]["kind"], **r))
    return out


def live_bytes(lifetimes: list[BufferLifetime]) -> list[int]:
    """Bytes of `lifetimes` live at each schedule position 0 .. max(end) (a value counts from
    its `start` through its `end`, both included); ``[]`` for no lifetimes."""
    if not lifetimes:
        return []
    diff = [0] * (max(b.end for b in lifetimes) + 2)
    for b in lifetimes:
        diff[b.start] += b.bytes
        diff[b.end + 1] -= b.bytes
    out, acc = [], 0
    for d in diff[:-1]:
        acc += d
        out.append(acc)
    return out


def loop_schedules(text: str) -> dict[str, list[str]]:
    """``{body name: [kind, ...]}`` for every while-loop body of a compiled HLO module's text
    that holds a dot and an all-gather or reduce-scatter: the `classify` kinds of its
    instructions in program order. These are the layer loops of a sharded model; XLA may
    unroll a loop with few iterations into its caller, which then has no body here."""
    comps = computations(text)
    out = {}
    for body in re.findall(r"body=%?([\w.\-]+)", text):
        seq = [k for line in comps.get(body, "").splitlines()[1:] if (k := classify(line, comps))]
        if "dot" in seq and ("all-gather" in seq or "reduce-scatter" in seq):
            out[body] = seq
    return out


def loop_direction(kinds: list[str]) -> str:
    """``"backward"`` for a layer-loop body that reduce-scatters gradients, else
    ``"forward"``."""
    return "backward" if "reduce-scatter" in kinds else "forward"


def op_label(kind: str, direction: str, prefetch: bool) -> str:
    """What an op of a layer-loop body does, in a user's terms: the layer an all-gather
    fetches (with prefetch: the next one in the loop's order, ``i+1`` forward and ``i-1``
    backward), a matmul, or a gradient's reduce-scatter (with prefetch: of the layer before,
    ``i+1``, one iteration late)."""
    if kind == "all-gather":
        if not prefetch:
            return "all-gather layer i"
        nxt = "i+1" if direction == "forward" else "i-1"
        return f"all-gather layer {nxt} (prefetch)"
    if kind == "reduce-scatter":
        if prefetch:
            return "reduce-scatter grad layer i+1 (delayed)"
        return "reduce-scatter grad layer i"
    if kind == "dot":
        return "matmul"
    return kind


@dataclasses.dataclass(frozen=True)
class CollectiveWindow:
    """One all-gather, reduce-scatter or collective-permute (a ring's hop) of a compiled
    computation, and the matmuls (GEMMs, attention and Pallas kernels) that can run beside
    it.

    `beside`: the dots (`classify`) of its computation that are neither among its operands'
    producers, transitively, nor among its result's consumers: nothing in the program orders
    them before or after it, so a scheduler may run them while it is in flight. `between`:
    for an asynchronous collective (``-start`` / ``-done``), the dots scheduled between its
    start and its done (what actually runs beside it); None for a synchronous one (a CPU
    program's). `elements`: elements of its result (an all-gather's gathered weight, a
    reduce-scatter's shard).
    """

    computation: str
    name: str
    kind: str
    elements: int
    beside: int
    between: int | None


#: The collectives `collective_windows` reports (a ring's hops are collective-permutes).
WINDOW_COLLECTIVES = ("all-gather", "reduce-scatter", "collective-permute")
#: Custom calls that compute beside a collective as a GEMM does: cuDNN's fused attention and
#: Pallas / Triton kernels (ring attention's flash blocks).
_KERNEL_TARGET = re.compile(r'custom_call_target="[^"]*(cudnn\$fmha|triton|mosaic)')


def collective_windows(text: str) -> list[CollectiveWindow]:
    """`CollectiveWindow` of every all-gather, reduce-scatter and collective-permute of a
    compiled HLO module's text (every computation: the entry, and loop bodies). Besides
    dots and GEMMs, attention and Pallas kernels count as the compute beside one."""
    comps = computations(text)
    out = []
    for cname, body in comps.items():
        lines = body.splitlines()[1:]
        parsed = [(p, line) for line in lines if (p := _parse(line))]
        names = [p[1] for p, _ in parsed]
        index = {n: i for i, n in enumerate(names)}
        kinds = [_window_kind(p, line, comps) for p, line in parsed]
        users: dict[int, list[int]] = {i: [] for i in range(len(parsed))}
        for i, (p, _) in enumerate(parsed):
            for a in p[4]:
                if a in index:
                    users[index[a]].append(i)

        def operands(i: int, parsed=parsed, index=index) -> list[int]:
            return [index[a] for a in parsed[i][0][4] if a in index]

        def consumers(i: int, users=users) -> list[int]:
            return users[i]

        for i, kind in enumerate(kinds):
            if kind not in WINDOW_COLLECTIVES:
                continue
            p = parsed[i][0]
            tied = _closure(i, operands) | _closure(i, consumers)
            done = None
            if p[3].endswith("-start"):
                done = next((j for j in sorted(users[i]) if parsed[j][0][3].endswith("-done")),
                            None)
                # the done's consumers are the collective's too
                if done is not None:
                    tied |= _closure(done, consumers)
            beside = sum(1 for j, k in enumerate(kinds) if k == "dot" and j not in tied
                         and j != i)
            between = None if done is None else sum(
                1 for j in range(i + 1, done) if kinds[j] == "dot")
            shapes = _LEAF.findall(p[2])
            # an async collective-permute's tuple: (operand, result, contexts...)
            at = 1 if p[3] == "collective-permute-start" and len(shapes) > 1 else -1
            leaf = shapes[at] if shapes else ("", "")
            elements = math.prod(int(d) for d in leaf[1].split(",") if d.strip()) \
                if leaf[1].strip() else 1
            out.append(CollectiveWindow(cname, p[1], kind, elements, beside, between))
    return out


def _window_kind(parsed: tuple, line: str, comps: dict[str, str]) -> str | None:
    """`classify`'s kind, with a collective-permute (not its done) as one, and an
    attention or Pallas kernel as ``"dot"`` (compute that can hide a collective)."""
    op = parsed[3]
    if op.startswith("collective-permute") and not op.endswith("done"):
        return "collective-permute"
    if op == "custom-call" and _KERNEL_TARGET.search(line):
        return "dot"
    return classify(line, comps)


def traced_windows(closed_jaxpr: Any) -> list[CollectiveWindow]:
    """`CollectiveWindow` of every ``all_gather``, ``reduce_scatter`` and ``psum`` (kind
    ``"all-reduce"``) of a traced program
    (``jax.make_jaxpr(f)(...)``), before XLA's passes: the program as gtp_jax builds it,
    optimization barriers included. Every nested jaxpr that holds collectives is read on
    its own (the sharded call's body, the backward pass's body); an equation whose nested
    jaxprs hold a ``dot_general`` counts as a matmul. `between` is None."""
    out: list[CollectiveWindow] = []
    seen: set[int] = set()

    def subjaxprs(eqn: Any) -> list[Any]:
        subs = []
        for v in eqn.params.values():
            for x in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(x, "jaxpr", x)
                if hasattr(inner, "eqns"):
                    subs.append(inner)
        return subs

    def has_dot(jaxpr: Any) -> bool:
        return any(e.primitive.name == "dot_general" or any(has_dot(s) for s in subjaxprs(e))
                   for e in jaxpr.eqns)

    def visit(jaxpr: Any, where: str) -> None:
        if id(jaxpr) in seen:
            return
        seen.add(id(jaxpr))
        eqns = jaxpr.eqns
        producer = {}
        for i, e in enumerate(eqns):
            for v in e.outvars:
                producer[v] = i
        operands = [[producer[v] for v in e.invars if not _is_literal(v) and v in producer]
                    for e in eqns]
        users: dict[int, list[int]] = {i: [] for i in range(len(eqns))}
        for i, ops in enumerate(operands):
            for j in ops:
                users[j].append(i)
        gemm = [e.primitive.name == "dot_general" or any(has_dot(s) for s in subjaxprs(e))
                for e in eqns]

        for i, e in enumerate(eqns):
            name = e.primitive.name
            if name in ("all_gather", "reduce_scatter") or name.startswith("psum"):
                tied = _closure(i, lambda j: operands[j]) | _closure(i, lambda j: users[j])
                beside = sum(1 for j in range(len(eqns)) if gemm[j] and j not in tied)
                shape = getattr(e.outvars[0].aval, "shape", ())
                kind = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter"}.get(
                    name, "all-reduce")
                out.append(CollectiveWindow(where, f"{name}#{i}", kind, math.prod(shape),
                                            beside, None))
            for s in subjaxprs(e):
                visit(s, f"{where}/{name}")

    visit(getattr(closed_jaxpr, "jaxpr", closed_jaxpr), "")
    return out


def _closure(start: int, step: Any) -> set[int]:
    """Every node reachable from `start` by `step` (node -> its neighbours), `start` not
    included unless a path returns to it."""
    found, todo = set(), [start]
    while todo:
        for j in step(todo.pop()):
            if j not in found:
                found.add(j)
                todo.append(j)
    return found


def _is_literal(v: Any) -> bool:
    from jax.extend.core import Literal  # noqa: PLC0415 - the text readers need no jax

    return isinstance(v, Literal)
