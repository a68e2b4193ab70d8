"""Root causes of a forensic step's bad spots (see :mod:`mpscope.recording.forensics`).

From each bad spot, :func:`analyse` walks back along the step's graph to where its error appears
(the **amplifier**: the first op, walking back, whose output is wrong while its inputs are only
rounded, or that is wrong by itself) and on to where the rounding that it amplifies entered (the
**source**: the op with the largest local error among the few before it). It names what happened
there in one closed vocabulary (:data:`MECHANISMS`), from the op's semantics and its operands'
values against their shadows, writes a short expression of the computation around it, and tries
the fixes a config can express by **replaying** the step's graph from the recorded inputs: the
amplifier's module in float32 (its ops' 16-bit inputs and outputs as float32, as autocast disabled
there and float32 parameters give), then bfloat16 instead of float16. A fix is *verified* when the
replayed spot is good (finite; a gradient non-zero wherever its shadow is; an update that changes the value).

Rows of ``run.tables["forensics"]``: :data:`COLUMNS`.
"""

from __future__ import annotations

import collections
import functools
import math

import pandas as pd
import torch


from mpscope.formats import FORMATS, dtype_name

LOW = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: A relative error above this is a value that is wrong, not rounded (spots, the walk).
WRONG = 0.5
#: The closed vocabulary of mechanisms (docs/advisor.md).
MECHANISMS = ("overflow", "underflow", "swamping", "cancellation", "saturation", "domain", "lost_constant",
              "resolution", "decision_flip", "loss_scale")
COLUMNS = ["step", "spot", "spot_name", "module", "op", "phase", "mechanism", "source_op", "source_module",
           "expression", "value", "message", "fix", "fix_modules", "fix_dtype", "fix_init_scale", "verified"]
#: Functions with an asymptote: the value they round onto when saturated.
SATURATING = {"sigmoid": (0.0, 1.0), "tanh": (-1.0, 1.0), "_softmax": (0.0, 1.0), "softmax": (0.0, 1.0),
              "exp": (0.0,), "erf": (-1.0, 1.0), "hardtanh": (-1.0, 1.0)}
#: Why a saturated function's backward vanishes (the saturation message).
BACKWARD_AT_ASYMPTOTE = {"sigmoid": "the sigmoid's backward y*(1-y) is exactly 0 at y = 1",
                         "tanh": "tanh's backward 1 - y^2 is exactly 0 at y = ±1",
                         "_softmax": "softmax's backward y*(g - sum(g*y)) is exactly 0 where y is 0 or 1",
                         "softmax": "softmax's backward y*(g - sum(g*y)) is exactly 0 where y is 0 or 1",
                         "exp": "exp's backward g*y is exactly 0 where y underflowed to 0",
                         "erf": "erf's derivative is 0 where it rounded to ±1",
                         "hardtanh": "hardtanh's derivative is 0 beyond ±1"}
#: Ops autocast runs in float16/bfloat16 (its lower-precision list): a replay gives them the recorded formats.
AUTOCAST_LOWERED = frozenset({"mm", "bmm", "addmm", "addbmm", "baddbmm", "matmul", "linear", "addmv", "mv", "dot",
                              "conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d",
                              "conv_transpose2d", "conv_transpose3d", "prelu", "_scaled_dot_product_attention",
                              "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
                              "_scaled_dot_product_efficient_attention", "_native_multi_head_attention"})
#: Ops whose output is NaN or infinite outside their domain or at a pole.
DOMAIN = frozenset({"sqrt", "rsqrt", "log", "log2", "log10", "log1p", "div", "reciprocal", "pow", "acos", "asin",
                    "atanh", "acosh", "xlogy", "special_xlog1py", "digamma", "lgamma", "polygamma", "fmod",
                    "remainder", "atan2"})
#: Periodic functions: their output follows the argument's absolute error, so a large argument's small
#: relative rounding (a timestep of 999 in bfloat16, whose spacing there is 4) makes them wrong.
PERIODIC = frozenset({"sin", "cos", "tan"})
#: The argument error (radians) at which a periodic function's output counts as resolution-bound.
PERIODIC_ERROR = 1e-2
#: Ops that only move values: no error of their own (the tracer gives them no evaluation of their own).
MOVES = frozenset({"t", "view", "_unsafe_view", "reshape", "expand", "slice", "select", "unsqueeze", "squeeze",
                   "permute", "transpose", "contiguous", "detach", "alias", "as_strided", "index_select", "gather",
                   "lift_fresh", "cat", "stack", "index", "split", "split_with_sizes", "chunk", "unbind", "narrow",
                   "repeat", "flatten", "unflatten", "clone", "_reshape_alias", "view_as", "expand_as", "movedim"})
#: What the walk and the expression pass through: moves, and casts.
MOVING = MOVES | {"_to_copy", "copy_"}


def analyse(fx, step: int) -> list[tuple]:
    """The rows (:data:`COLUMNS`) of step ``step``'s bad spots, one per (mechanism, module, op)."""
    nodes = fx.nodes
    rows: dict = {}
    spots = _first_of_each(fx.spots)
    if any(_loops_own(nodes[s.seq]) for s in spots if s.kind == "decision"):
        grads = _gradient_nodes(fx)
        spots = [s for s in spots
                 if s.kind != "decision" or not _loops_own(nodes[s.seq]) or _feeds_the_step(nodes, s.seq, grads)]
    if spots:  # (a step without a bad spot never pays for the rebuild and the error measures)
        fx.rebuild()
        for n in nodes:
            fx.measure(n)
    for spot in spots:
        for row in _diagnose(fx, nodes, spot, step):
            key = (row[6], row[3], row[4])
            if key not in rows:
                rows[key] = row
    return list(rows.values())


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` (L2 over all elements, in float64): a model output's error."""
    r = ref.double()
    return float((x.detach().double() - r).norm() / r.norm().clamp_min(torch.finfo(torch.float64).tiny))


def set_flips(o: torch.Tensor, s: torch.Tensor, dim: int) -> float:
    """The fraction of top-k picks ``o`` (indices along ``dim``) that the shadow's picks ``s`` do not
    hold: top-k decides a set (its order among the picks is its own, unsorted or by value)."""
    if s is None or not isinstance(s, torch.Tensor) or s.shape != o.shape or not o.numel():
        return 0.0
    a, b = o.movedim(dim, -1), s.to(o.dtype).movedim(dim, -1)
    held = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1)
    return float((~held).sum()) / o.numel()


def _loops_own(n) -> bool:
    """An op of the loop's own, outside the model's forward (the loss, a metric, a check on gradients)."""
    return n.module == "" and n.phase not in ("forward", "eval")


def _gradient_nodes(fx) -> set:
    """The seqs of the nodes that made the parameters' gradients as they are now."""
    out = set()
    for p in fx.params.values():
        g = p.grad
        if g is not None:
            hit = fx.producer.get((id(g), g._version)) or fx.by_memory.get((g.data_ptr(), g.shape, g.dtype))
            if hit is not None:
                out.add(hit[0])
    return out


def _feeds_the_step(nodes, seq: int, grads: set) -> bool:
    """Whether node ``seq``'s outputs reach, through the ops that read them, a forward of the model (a
    sampled token fed back), a parameter's gradient (a loss it masks; ``grads``: the nodes that made
    them), the optimizer, state or communication. A decision of the loop's own that reaches none (an
    accuracy, a count the loop prints) changes nothing the step trains or the model computes."""
    readers: dict = {}
    for n in nodes[seq + 1:]:
        for p in n.prod:
            if p is not None and p[0] >= seq:
                readers.setdefault(p[0], []).append(n)
    frontier, seen = [seq], {seq}
    while frontier:
        nxt = []
        for q in frontier:
            for n in readers.get(q, ()):
                if n.phase in ("forward", "eval", "optimizer", "state", "communication") or n.seq in grads:
                    return True
                if n.seq not in seen:
                    seen.add(n.seq)
                    nxt.append(n.seq)
        frontier = nxt
    return False


def frame(rows: list) -> pd.DataFrame:
    if not rows:
        return pd.DataFrame({c: pd.Series(dtype="int64" if c == "step" else ("float64" if c in ("value", "fix_init_scale") else
                             ("bool" if c == "verified" else "object"))) for c in COLUMNS})
    return pd.DataFrame(rows, columns=COLUMNS)


def _first_of_each(spots):
    """The first non-finite spot of the step (later ones follow from it), every other spot."""
    out, nonfinite = [], False
    for s in spots:
        if s.kind == "nonfinite":
            if nonfinite:
                continue
            nonfinite = True
        out.append(s)
    return out


def bad_fraction(x: torch.Tensor, ref: torch.Tensor, same_inf_right: bool = False) -> float:
    """The fraction of ``x``'s elements that are wrong against the float64 reference ``ref``: relative
    error above :data:`WRONG`, non-finite where ``ref`` is finite, or exactly 0 where ``ref`` is not. An
    infinity that ``ref`` has too is wrong (the op made it: a pole, an overflow) unless
    ``same_inf_right`` (an op that only carries an infinity its input already held)."""
    if x.numel() == 0 or ref.shape != x.shape:
        return 0.0
    xd = x.detach().to(ref.dtype)
    diff = (xd - ref).abs_()
    thr = ref.abs().mul_(WRONG).masked_fill_(ref == 0, math.inf)  # (|ref| = inf: never wrong; NaN: below)
    wrong = diff > thr  # (x non-finite where ref is finite: diff is inf or NaN)
    nan = (diff != diff) & (ref == ref)
    wrong |= nan & (xd != ref) if same_inf_right else nan
    return float(wrong.sum()) / x.numel()


# --------------------------------------------------------------------------- the walk
def _walk(nodes, seq: int, idx: int, limit: int = 64):
    """The chain from the spot's node back to the amplifier: ``[(node, output index), ...]``; the last
    entry is the amplifier (its inputs are not wrong, or it is wrong by itself in at least half of the
    elements where it is wrong: a cast that flushes a few values of an input already wrong is passed)."""
    chain = []
    cur = (seq, idx)
    while cur is not None and len(chain) < limit:
        n = nodes[cur[0]]
        chain.append((n, cur[1]))
        if cur[1] < len(n.local_bad) and n.local_bad[cur[1]] > 0 and \
                n.local_bad[cur[1]] >= 0.5 * n.global_bad[cur[1]]:
            break  # (wrong by itself for at least half of its wrong elements: the error enters here)
        best, bad = None, 0.0
        for a, p in zip(n.flat, n.prod):
            if p is None or not isinstance(a, torch.Tensor) or a.dtype not in _FLOATS:
                continue
            g = nodes[p[0]].global_bad[p[1]] if p[1] < len(nodes[p[0]].global_bad) else 0.0
            if g > bad:
                best, bad = p, g
        cur = best
    return chain


def _source(nodes, amp, limit: int = 8):
    """Where the rounding the amplifier amplifies entered: among the ops at most ``limit`` steps before
    it (following each input), the one with the largest local error relative to its output's size."""
    best, best_rel = None, 0.0
    frontier, seen = [amp.seq], set()
    for _ in range(limit):
        nxt = []
        for s in frontier:
            n = nodes[s]
            for a, p in zip(n.flat, n.prod):
                if p is None or p[0] in seen or not isinstance(a, torch.Tensor) or a.dtype not in _FLOATS:
                    continue
                seen.add(p[0])
                m = nodes[p[0]]
                if m.packet not in MOVING:
                    o = m.outs[p[1]]
                    size = float(o.detach().abs().max()) if o.numel() and o.dtype in _FLOATS else 0.0
                    rel = m.abs_err[p[1]] / size if size > 0 and math.isfinite(size) else 0.0
                    # (the amplifier's own module first: the computation a fix there would cover)
                    if rel > 0 and (best is None or (m.module == amp.module, rel) > (best.module == amp.module, best_rel)):
                        best, best_rel = m, rel
                nxt.append(p[0])
        frontier = nxt
    return best, best_rel


def _producer(nodes, node, j):
    p = node.prod[j]
    return (nodes[p[0]], p[1]) if p is not None else (None, None)


def _through_moves(nodes, node, j):
    """The node that made input ``j`` of ``node``, passing through ops that only move values; and the
    leaf tensor when it comes from outside the step."""
    n, i = _producer(nodes, node, j)
    leaf = node.flat[j]
    for _ in range(16):
        if n is None or n.packet not in MOVING:
            break
        k = next((k for k, a in enumerate(n.flat) if isinstance(a, torch.Tensor) and a.dtype in _FLOATS), None)
        if k is None:
            break
        leaf = n.flat[k]
        n, i = _producer(nodes, n, k)
    return n, i, leaf


# --------------------------------------------------------------------------- mechanisms
def _tensors(node):
    return [(j, a) for j, a in enumerate(node.flat) if isinstance(a, torch.Tensor) and a.dtype in _FLOATS]


def _at_asymptote(nodes, node, j):
    """(function node, asymptote value, count) when input ``j`` of ``node`` is the output of a saturating
    function sitting exactly at its asymptote where its shadow is not."""
    m, i, _ = _through_moves(nodes, node, j)
    if m is None or m.packet not in SATURATING:
        return None
    y, s = m.outs[i], m.shadows[i]
    if y.dtype not in _FLOATS or s is None:
        return None
    for v in SATURATING[m.packet]:
        hit = (y.detach().double() == v) & (s != v)
        n = int(hit.sum())
        if n:
            return m, v, n, y.numel()
    return None


def _leaf_name(fx, t):
    return fx.param_names.get(id(t)) or fx.buffer_names.get(id(t))


def _leaf_of(fx, nodes, node, j):
    """The named parameter or buffer input ``j`` of ``node`` comes from (through moves), or None."""
    m, i, leaf = _through_moves(nodes, node, j)
    if m is not None:
        return None, None
    # a view of a buffer: the tensor the first move read
    name = _leaf_name(fx, leaf)
    if name is None and isinstance(leaf, torch.Tensor) and leaf._base is not None:
        name = _leaf_name(fx, leaf._base)
        leaf = leaf._base
    return name, leaf


def _exact_zero(fx, nodes, node, j):
    """How input ``j`` of ``node`` became exactly 0: a subtraction of two equal values (``1 - a`` with
    ``a`` rounded onto 1.0), with the leaf it came from. Returns a dict or None."""
    m, i, _ = _through_moves(nodes, node, j)
    if m is None or m.packet not in ("sub", "rsub", "add"):
        return None
    z = m.outs[i]
    if not bool((z == 0).any()):
        return None
    ops = _tensors(m)
    scal = [a for a in m.flat if isinstance(a, (int, float)) and not isinstance(a, bool)]
    info = {"op": m, "zeros": int((z == 0).sum()), "numel": z.numel()}
    for k, a in ops:
        name, leaf = _leaf_of(fx, nodes, m, k)
        vals = a.detach().double()
        if scal and bool((vals == abs(scal[0])).any()):
            info.update(value=abs(scal[0]), count=int((vals == abs(scal[0])).sum()), dtype=dtype_name(a.dtype))
        if name is not None:
            info.update(leaf=name, leaf_tensor=leaf, leaf_dtype=dtype_name(leaf.dtype))
    return info


def _classify(fx, nodes, chain, spot):
    """(mechanism, amplifier node, words, numbers dict) for a walk's chain."""
    amp, ai = chain[-1]
    o = amp.outs[ai]
    s = amp.shadows[ai] if ai < len(amp.shadows) else None
    facts: dict = {}
    p = amp.packet
    if spot.kind == "update":  # (lost increments below the least subnormal: even from 0 they round away)
        d = spot.detail
        return ("resolution" if d.get("integers") else
                "underflow" if d.get("underflowed", 0.0) > 0.5 else "swamping"), amp, facts
    if spot.kind == "decision":
        x = amp.flat[0] if amp.flat else None
        if amp.packet in ("_to_copy", "to", "_convert_element_type") and isinstance(x, torch.Tensor) and x.dtype in LOW:
            limit = 2.0 ** (FORMATS[dtype_name(x.dtype)].mantissa_bits + 1)
            top = float(x.detach().abs().float().max())
            if top > limit:  # integers past what the format counts exactly, made an index
                facts.update(limit=limit, top=top, dtype=dtype_name(x.dtype))
                return "resolution", amp, facts
        return "decision_flip", amp, facts
    if o.dtype in _FLOATS and s is not None:
        od = o.detach().double()
        fin_s = torch.isfinite(s)
        fmt = FORMATS.get(dtype_name(o.dtype))
        over = (~torch.isfinite(od)) & fin_s
        if fmt is not None and bool(over.any()) and float(s[over].abs().max()) > fmt.max:
            facts.update(count=int(over.sum()), shadow_max=float(s[over].abs().max()), limit=fmt.max,
                         zeroed=zeroed_inputs(nodes, amp))
            return "overflow", amp, facts
        lost = _lost_constant(nodes, amp, depth=1)
        wrong = (~torch.isfinite(od)) | ((od == 0) & (s != 0))
        if lost is not None and bool(wrong.any()):
            facts.update(lost, count=int((~torch.isfinite(od)).sum()) or int(((od == 0) & (s != 0)).sum()))
            return "lost_constant", amp, facts
        hit = _flushed(amp, ai)
        if hit is not None:
            facts.update(hit)
            return "underflow", amp, facts
    # saturation: an input sits at a saturating function's asymptote
    for j, _ in _tensors(amp):
        hit = _at_asymptote(nodes, amp, j)
        if hit is not None:
            m, v, n, numel = hit
            facts.update(function=m, asymptote=v, count=n, numel=numel)
            return "saturation", amp, facts
    if p.rstrip("_") in DOMAIN and o.dtype in _FLOATS and not bool(torch.isfinite(o).all()):
        facts.update(count=int((~torch.isfinite(o)).sum()), numel=o.numel())
        ins = _tensors(amp)
        if ins:
            j, x = ins[-1] if p.startswith("div") else ins[0]  # (a division's pole is its divisor's zero)
            x = x.detach().double()
            facts["negative"] = int((x < 0).sum())
            facts["zero"] = int((x == 0).sum())
            s_in = _input_shadow(nodes, amp, j)
            if s_in is not None:
                facts["shadow_negative"] = int((s_in < 0).sum())
                facts["x_min"], facts["shadow_min"] = float(x.min()), float(s_in.min())
        lost = _lost_constant(nodes, amp)
        if lost is not None:
            facts.update(lost)
            return "lost_constant", amp, facts
        for j, _ in (ins[::-1] if p.startswith("div") else ins):  # (a divisor first)
            z = _exact_zero(fx, nodes, amp, j)
            if z is not None:
                facts["zero_from"] = z
                sub = z["op"]
                for k, _ in _tensors(sub):  # 1 - y with y a saturated function's output
                    hit = _at_asymptote(nodes, sub, k)
                    if hit is not None:
                        m, v, n, numel = hit
                        facts.update(function=m, asymptote=v, count=n, numel=numel, pole=amp)
                        return "saturation", amp, facts
                break
        if "zero_from" not in facts:  # a zero that is an underflow (sigma ** 2 below fp16's range)
            for j, _ in (ins[::-1] if p.startswith("div") else ins):
                under = _underflowed_into(nodes, amp, j)
                if under is not None:
                    facts.update(under[1])
                    return "underflow", under[0], facts
        # a cancellation feeding the domain error
        for j, _ in ins:
            m, i, _ = _through_moves(nodes, amp, j)
            if m is not None and m.packet in ("sub", "add", "rsub") and m.global_bad[i] > 0:
                facts["cancellation"] = _cancel_facts(m, i)
                break
        return "domain", amp, facts
    for n, _ in chain:  # a periodic function on the way (the walk may go on into its argument's rounding)
        if n.packet.rstrip("_") in PERIODIC and _periodic_facts(nodes, n, facts):
            return "resolution", n, facts
    if p in ("sub", "add", "rsub", "sub_", "add_"):
        facts.update(_cancel_facts(amp, ai))
        return "cancellation", amp, facts
    return None, amp, facts  # no mechanism of the vocabulary fits: no story is invented


def _lost_constant(nodes, amp, depth: int = 4):
    """A constant of an op feeding ``amp`` (within ``depth`` ops up its inputs) that its format rounds
    onto 1, -1 or 0 (``clamp(max=1 - 1e-6)`` in float16 is ``clamp(max=1)``): ``{"constant", "rounded",
    "op"}`` or None."""
    frontier = [amp]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            o = n.outs[0] if n.outs else None
            if o is not None and o.dtype in LOW:
                for a in n.flat:
                    if isinstance(a, float) and a not in (0.0, 1.0, -1.0):
                        r = float(torch.tensor(a, dtype=torch.float64).to(o.dtype))
                        if r in (0.0, 1.0, -1.0):
                            return {"constant": a, "rounded": r, "op": n, "dtype": dtype_name(o.dtype)}
            nxt += [nodes[q[0]] for q in n.prod if q is not None]
        frontier = nxt
    return None


def zeroed_inputs(nodes, amp) -> int:
    """Elements of a domain op's inputs that are exactly 0 where their shadow is not (an underflow that
    lands on the op's pole); 0 for other ops."""
    if amp.packet.rstrip("_") not in DOMAIN:
        return 0
    n = 0
    for j, a in _tensors(amp):
        sh = _input_shadow(nodes, amp, j)
        if sh is not None and sh.shape == a.shape:
            n += int(((a == 0) & (sh != 0)).sum())
    return n


def _underflowed_into(nodes, node, j, limit: int = 4):
    """(node, facts) of the op whose underflow to 0 input ``j`` of ``node`` carries (through moves and
    products: ``2 * var``), or None."""
    m, _, _ = _through_moves(nodes, node, j)
    found = None
    for _ in range(limit):
        if m is None:
            break
        hit = _flushed(m)
        if hit is None and found is not None:
            break  # (the deepest op that flushed: its input was not 0)
        if hit is not None:
            found = (m, hit)
        if m.packet not in ("mul", "div", "neg", "abs") or not _tensors(m):
            break
        m, _, _ = _through_moves(nodes, m, _tensors(m)[0][0])
    return found


def _flushed(n, i: int = 0):
    """``{"count", "shadow_max", "limit"}`` when node ``n``'s output ``i`` is exactly 0 where its shadow
    is a finite value below the format's smallest normal (an underflow), else None."""
    if n is None or i >= len(n.outs) or i >= len(n.shadows) or n.shadows[i] is None:
        return None
    o, s = n.outs[i].detach().double(), n.shadows[i]
    fmt = FORMATS.get(dtype_name(n.outs[i].dtype)) if n.outs[i].dtype in _FLOATS else None
    if fmt is None or s.shape != o.shape:
        return None
    flushed = (o == 0) & (s != 0) & torch.isfinite(s)
    if not bool(flushed.any()) or not float(s[flushed].abs().max()) < fmt.min_normal:
        return None
    return {"count": int(flushed.sum()), "shadow_max": float(s[flushed].abs().max()), "limit": fmt.min_normal}


def _periodic_facts(nodes, n, facts: dict) -> bool:
    """Whether periodic ``n``'s argument carries an absolute error of at least :data:`PERIODIC_ERROR`
    (filling ``facts``: the error, the argument's size, and where it was rounded to 16 bits)."""
    ins = _tensors(n)
    if not ins:
        return False
    j, x = ins[0]
    s_in = _input_shadow(nodes, n, j)
    if s_in is None or s_in.shape != x.shape:
        return False
    err = (x.detach().to(s_in.dtype) - s_in).abs().nan_to_num(0.0, 0.0, 0.0)
    if not float(err.max()) >= PERIODIC_ERROR:
        return False
    facts.update(abs_err=float(err.max()), x_max=float(s_in.abs().max()),
                 rel_err=float((err / s_in.abs().clamp_min(1e-30)).max()))
    r = _rounded_at(nodes, n, j)
    if r is not None:  # where the argument (or what it is made from) was rounded to 16 bits
        top = float(r.shadows[0].abs().max()) if r.shadows and r.shadows[0] is not None else 0.0
        fmt = FORMATS[dtype_name(r.outs[0].dtype)]
        facts.update(rounded=r, rounded_max=top, dtype=dtype_name(r.outs[0].dtype),
                     spacing=2.0 ** (math.floor(math.log2(top)) - fmt.mantissa_bits) if top > 0 else 0.0)
    return True


def _rounded_at(nodes, node, j, limit: int = 8):
    """The nearest op up input ``j`` of ``node`` (at most ``limit`` ops back, along floating inputs)
    whose output is 16-bit: where the value was rounded to 16 bits (a cast, or an op autocast ran in
    16 bits). None when there is none."""
    m, _ = _producer(nodes, node, j)
    for _ in range(limit):
        if m is None:
            return None
        if m.outs and m.outs[0].dtype in LOW and m.packet not in MOVES:  # (a view of it: further up)
            return m
        k = next((k for k, a in enumerate(m.flat) if isinstance(a, torch.Tensor) and a.dtype in _FLOATS
                  and m.prod[k] is not None), None)
        if k is None:
            return None
        m, _ = _producer(nodes, m, k)
    return None


def _input_shadow(nodes, node, j):
    m, i = _producer(nodes, node, j)
    if m is None:
        return None
    return m.shadows[i] if i < len(m.shadows) else None


def _cancel_facts(m, i) -> dict:
    terms = [float(a.detach().double().abs().nan_to_num(0.0, 0.0, 0.0).max()) for _, a in _tensors(m) if a.numel()]
    out = m.outs[i].detach().double()
    s = m.shadows[i]
    return {"op": m, "terms": float(max(terms)) if terms else math.nan,
            "out_min": float(out.min()), "shadow_min": float(s.min()) if s is not None else math.nan,
            "bad": m.global_bad[i]}


# --------------------------------------------------------------------------- expression
def expression(fx, nodes, node, depth: int = 3) -> str:
    """``packet(args...)`` of ``node`` down to ``depth`` ops (moves are passed through; leaves by name)."""
    def arg(a, p, d):
        if isinstance(a, torch.Tensor):
            if p is not None and d > 0:
                m = nodes[p[0]]
                while m.packet in MOVING:
                    k = next((k for k, b in enumerate(m.flat) if isinstance(b, torch.Tensor)), None)
                    if k is None or m.prod[k] is None:
                        name = _leaf_name(fx, m.flat[k]) if k is not None else None
                        return name or "x"
                    m = nodes[m.prod[k][0]]
                return show(m, d - 1)
            return _leaf_name(fx, a) or ("..." if p is not None else "x")
        if isinstance(a, float):
            return f"{a:g}"
        if isinstance(a, (int, bool)):
            return str(a)
        return None

    def show(n, d):
        args = [arg(a, p, d) for a, p in zip(n.flat, n.prod)]
        args = [a for a in args if a is not None][:4]
        return f"{n.packet.strip('_')}({', '.join(args)})"
    return show(node, depth)


# --------------------------------------------------------------------------- replay
#: Namespaces of torch.distributed's collectives (c10d ops, functional collectives).
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd"})


#: Ops that write arguments their schema does not mark written: BatchNorm's running mean and variance.
_UNDECLARED_WRITES = {"native_batch_norm": (3, 4), "cudnn_batch_norm": (3, 4), "miopen_batch_norm": (3, 4)}


def flatten(tree) -> tuple[list, object]:
    """``(leaves, spec)`` of an op's ``(args, kwargs)``: tuples, lists and dicts are opened (other
    values, ``torch.Size`` included, are leaves); :func:`unflatten` builds it again. (PyTorch's pytree
    does the same for these types, at several times the cost per op.)"""
    leaves: list = []
    return leaves, _flat_into(tree, leaves)


def _flat_into(x, leaves):
    t = type(x)
    if t is tuple or t is list:
        return (t, [_flat_into(a, leaves) for a in x])
    if t is dict:
        return (dict, list(x), [_flat_into(v, leaves) for v in x.values()])
    leaves.append(x)
    return None


def unflatten(leaves, spec):
    """The tree :func:`flatten` gave ``spec`` for, with ``leaves`` in its leaves' places."""
    return _build(spec, iter(leaves))


def _build(spec, it):
    if spec is None:
        return next(it)
    kind = spec[0]
    if kind is dict:
        return {k: next(it) if s is None else _build(s, it) for k, s in zip(spec[1], spec[2])}
    vals = [next(it) if s is None else _build(s, it) for s in spec[1]]
    return vals if kind is list else tuple(vals)


def tensors_of(tree) -> list:
    """The tensors in an op's output (tuples, named tuples, lists and dict values opened), in order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for a in tree for t in tensors_of(a)]
    if isinstance(tree, dict):
        return [t for a in tree.values() for t in tensors_of(a)]
    return []


@functools.lru_cache(maxsize=None)
def mutated_positions(func) -> tuple:
    """Positions of the positional arguments after the first that an op writes (its schema marks them
    ``(a!)``, or :data:`_UNDECLARED_WRITES`): BatchNorm's running statistics. Their new values count
    as the op's outputs, after its returned ones."""
    undeclared = _UNDECLARED_WRITES.get(func.overloadpacket.__name__)
    if undeclared is not None:
        return undeclared
    return tuple(i for i, a in enumerate(func._schema.arguments)
                 if i > 0 and not a.kwarg_only and a.alias_info is not None and a.alias_info.is_write)


def mutated_args(func, args) -> list:
    return [args[i] for i in mutated_positions(func) if i < len(args) and isinstance(args[i], torch.Tensor)]


def collective(func) -> bool:
    """Whether an op is a torch.distributed collective (an all-reduce of DDP's buckets, a comm hook's):
    never run again by mpscope, since the other ranks would not take part."""
    return getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES


def replay(fx, nodes, upto: int, promote, subst: dict | None = None) -> dict:
    """Re-run nodes ``0..upto`` of the graph where a fix changes them: ``promote(node)`` gives the float
    format a node's 16-bit inputs take (None: as recorded); ``subst``: ``{id(a tensor the step reads), or
    the (seq, index) of a node output: the value a fix gives it}`` (the GradScaler's scale); nodes
    downstream of a changed value run
    on it with their recorded input formats; a collective keeps its recorded output. Returns ``{(seq, index): value}`` of the re-run outputs."""
    vals: dict = {}
    for n in nodes[:upto + 1]:
        if collective(n.func):  # (its recorded output stands: a replay on one rank cannot reduce)
            continue
        to = promote(n)
        if to is None and not any(p is not None and p in vals for p in n.prod) and not (
                subst and any(id(a) in subst or p in subst for a, p in zip(n.flat, n.prod))):
            continue
        out = ran = None  # (an in-place foreach op returns None: ``ran`` tells it from a failure)
        # a wider value keeps its format into ops autocast does not lower (type promotion, as in the real
        # run); ops it lowers (matmuls, convolutions), and any op refusing mixed formats, get the recorded ones
        for keep in ((to is not None or n.packet not in AUTOCAST_LOWERED), False):
            args, kwargs = _replay_args(n, vals, to, keep, subst)
            try:
                out, ran = n.func(*args, **kwargs), True
                break
            except Exception:
                continue
        if not ran:
            continue
        outs = tensors_of(out)
        if n.inplace and not outs and args:
            outs = [args[0]] if isinstance(args[0], torch.Tensor) else [t for t in args[0] if isinstance(t, torch.Tensor)]
        outs += mutated_args(n.func, args)
        for i, t in enumerate(outs):
            vals[(n.seq, i)] = t
    return vals


def _replay_args(n, vals, to, keep: bool, subst: dict | None = None):
    """(args, kwargs) of node ``n`` for a replay: re-run inputs from ``vals``, recorded ones otherwise;
    16-bit floats as ``to`` when given; a re-run value's wider format kept when ``keep``, else the
    recorded format; an in-place op's target a copy (the recorded values are never written)."""
    flat = []
    for a, p in zip(n.flat, n.prod):
        v = subst[id(a)] if subst and id(a) in subst else subst[p] if subst and p in subst else \
            (vals.get(p, a) if p is not None else a)
        if isinstance(a, torch.Tensor) and a.dtype in _FLOATS and isinstance(v, torch.Tensor):
            want = to if (to is not None and a.dtype in LOW) else a.dtype
            if keep and to is None and v.itemsize > torch.empty((), dtype=want).element_size():
                want = v.dtype
            if v.dtype != want:
                v = v.to(want)
        flat.append(v)
    if n.inplace or mutated_positions(n.func):
        flat = [v.clone() if isinstance(v, torch.Tensor) and any(v is a for a in n.flat) else v for v in flat]
    args, kwargs = unflatten(flat, n.spec)
    kwargs = dict(kwargs)
    if to is not None and kwargs.get("dtype") in LOW:
        kwargs["dtype"] = to
    return args, kwargs


def _in(module: str, m: str) -> bool:
    return module == m or module.startswith(m + ".")


_FORWARD_PHASES = frozenset({"forward", "eval", "loss"})


def _horizon(nodes, spot) -> int:
    """The last node a replay for a non-finite spot runs to: the end of its forward part of the step (all
    passes: a generation's later tokens too), or of its backward; other spots, the spot itself. A fix
    is verified only if every later non-finite value it should prevent is finite in the replay too."""
    if spot.kind != "nonfinite":
        return spot.seq
    phase = nodes[spot.seq].phase
    group = _FORWARD_PHASES if phase in _FORWARD_PHASES else {phase}
    return max((n.seq for n in nodes[spot.seq:] if n.phase in group), default=spot.seq)


def _step_function(chain):
    """(seq, index) of the first step function (``sign``, ``round``, ...) on a walk's chain, or None:
    an output after one is judged there (see :func:`_spot_good`)."""
    return next(((n.seq, i) for n, i in chain if n.packet.rstrip("_") in STEP_FUNCTIONS), None)


#: Floating ops whose output jumps where their input crosses a threshold: what follows one depends on
#: which side each element fell, not on how close it is.
STEP_FUNCTIONS = frozenset({"sign", "sgn", "round", "floor", "ceil", "trunc", "heaviside"})


def _spot_good(spot, nodes, vals, judge=None) -> bool | None:
    """Whether the replayed spot is good; None when the replay did not reach it. A non-finite spot is
    good when its value and every later replayed value of the forward, the backward and its own phase
    that was non-finite where its shadow is finite are finite (a fix of the first overflow that leaves
    the next layer's, or the backward's, is no fix); for a forward's spot, but for backward values that
    carry the loss scale and fit the replay's format once unscaled (GradScaler's probe of its scale: it
    skips and backs off). An output spot reached through a step function (``judge``, its (seq, index):
    :func:`_step_function`) is good when at most a tenth of the step function's elements that were off
    their shadow still are."""
    if spot.kind == "output" and judge is not None:  # (an output after a step function: that step's
        # elements on the shadow's side; the output itself stays far off float64 wherever one element
        # near the threshold falls the other way, fixed or not)
        n, v = nodes[judge[0]], vals.get(judge)
        s = n.shadows[judge[1]] if judge[1] < len(n.shadows) else None
        if v is None or s is None or v.shape != s.shape:
            return None
        before = float((n.outs[judge[1]].to(s.dtype) != s).float().mean())
        return float((v.to(s.dtype) != s).float().mean()) <= 0.1 * before
    v = vals.get((spot.seq, spot.index))
    if v is None:
        return None
    if spot.kind == "nonfinite":
        if not bool(torch.isfinite(v).all()):
            return False
        forward = nodes[spot.seq].phase in _FORWARD_PHASES
        group = _FORWARD_PHASES | {"backward", nodes[spot.seq].phase}
        for (seq, i), r in vals.items():
            n = nodes[seq]
            if seq <= spot.seq or n.phase not in group or i >= len(n.outs) or i >= len(n.shadows) or \
                    n.shadows[i] is None:
                continue
            o, sh = n.outs[i], n.shadows[i]
            if o.dtype in _FLOATS and r.shape == o.shape and sh.shape == o.shape:
                bad = ~torch.isfinite(o) & torch.isfinite(sh)
                if bool(bad.any()) and not bool(torch.isfinite(r[bad]).all()):
                    if forward and n.phase == "backward" and n.scaled and r.is_floating_point() and \
                            float(sh[bad].abs().max()) / n.scaled <= torch.finfo(r.dtype).max:
                        continue  # (GradScaler's probe of its scale, for a forward's fix: it backs off; in the
                        # format the fix computes it in)
                    return False
        return True
    if spot.kind == "gradient":
        s = spot.shadow
        lost = ((v == 0) | ~torch.isfinite(v)) & (s.abs() > spot.detail.get("floor", 0.0)) & torch.isfinite(s)
        return float(lost.sum()) / v.numel() < 0.2 * spot.value
    if spot.kind == "decision":
        s = nodes[spot.seq].shadows[spot.index]
        if s is None:
            return False
        dim = spot.detail.get("set_dim")
        flips = float((v != s.to(v.dtype)).float().mean()) if dim is None else set_flips(v, s, dim)
        return flips < 0.1 * spot.value
    if spot.kind == "output":
        s = nodes[spot.seq].shadows[spot.index]
        return s is not None and s.shape == v.shape and rel_l2(v, s) <= 0.1 * spot.value
    if spot.kind == "update":
        n = nodes[spot.seq]
        before = n.flat[0]
        s_change = n.shadows[0] - before.double()
        meant = s_change != 0
        lost = meant & (v.double() - before.double() == 0)
        return float(lost.sum()) / max(1, int(meant.sum())) < 0.05
    return None


def _module_candidates(fx, nodes, spot, module: str, amp=None):
    """The module sets a replay tries in float32: the amplifier's module; for a decision, or an amplifier
    outside every module (the loop's, or the root's own ops), also each outermost module its inputs come
    through, nearest first (at most :data:`UPSTREAM_CANDIDATES`), then all of them. Never the root."""
    out = [(module,)] if module else []
    if spot.kind == "decision" or (not module and amp is not None):
        start = spot.seq if spot.kind == "decision" else amp.seq
        order, frontier, seen = [], collections.deque([start]), {start}
        while frontier:  # breadth first: the modules nearest the decision come first
            n = nodes[frontier.popleft()]
            if n.module and n.module not in order:
                order.append(n.module)
            for q in n.prod:
                if q is not None and q[0] not in seen:
                    seen.add(q[0])
                    frontier.append(q[0])
        outer = [m for m in order if not any(o != m and _in(m, o) for o in order)][:UPSTREAM_CANDIDATES]
        for cand in [(m,) for m in outer] + ([tuple(sorted(outer))] if len(outer) > 1 else []):
            if cand not in out:
                out.append(cand)
    return out


#: ``fix_dtype`` of a fix that keeps the parameters and the optimizer state in float32 (master weights).
MASTER_WEIGHTS = "float32"

#: The most modules upstream of an amplifier that replays try one by one.
UPSTREAM_CANDIDATES = 4


def _decision_source(nodes, spot):
    """The op nearest a decision whose own rounding its inputs carry: the first op, breadth first up
    from the decision (through moves), with a local error."""
    frontier, seen = collections.deque([spot.seq]), {spot.seq}
    while frontier:
        n = nodes[frontier.popleft()]
        if n.seq != spot.seq and n.packet not in MOVING and any(e > 0 for e in n.abs_err):
            return n
        for q in n.prod:
            if q is not None and q[0] not in seen:
                seen.add(q[0])
                frontier.append(q[0])
    return None


def _try_fixes(fx, nodes, spot, module: str, run_dtype, mech=None, amp=None, judge=None):
    """(fix_modules, fix_dtype, fix_init_scale, verified) for a spot whose amplifier runs in ``module``."""
    if spot.seq < 0 or (spot.kind == "update" and nodes[spot.seq].phase == "optimizer"):
        return [], None, None, False  # (no config but float32 master weights: param_dtype)
    upto = _horizon(nodes, spot)
    if mech == "underflow" and amp is not None and amp.phase == "backward" and run_dtype == torch.float16:
        scale = _higher_scale(fx, nodes)  # the smallest change first: the GradScaler's scale, no format
        if scale is not None:
            st, new = scale
            value = st * (new / float(st))
            subst = {id(st): value}  # (made in the step, the first one's lazy init: each output that was it)
            subst.update({(seq, i): value for seq, i, *_ in fx.held.get(id(st), (None, ()))[1]})
            if _spot_good(spot, nodes, replay(fx, nodes, upto, lambda n: None, subst), judge):
                return [], None, new, True
    if amp is not None and amp.phase == "optimizer":  # 16-bit parameters or state in the optimizer's math
        vals = replay(fx, nodes, upto, lambda n: torch.float32 if n.phase == "optimizer" and any(
            isinstance(a, torch.Tensor) and a.dtype in LOW for a in n.flat) else None)
        if _spot_good(spot, nodes, vals, judge):
            return [], MASTER_WEIGHTS, None, True
    for mods in _module_candidates(fx, nodes, spot, module, amp):
        vals = replay(fx, nodes, upto, lambda n: torch.float32 if any(_in(n.module, m) for m in mods) or
                      (spot.kind == "update" and n.seq == spot.seq) else None)
        if _spot_good(spot, nodes, vals, judge):
            return list(mods), None, None, True
    if run_dtype == torch.float16:
        vals = replay(fx, nodes, upto, lambda n: torch.bfloat16 if any(  # (and casts to float16: bf16's)
            (isinstance(a, torch.Tensor) and a.dtype == torch.float16) or a is torch.float16 for a in n.flat)
            else None)
        if _spot_good(spot, nodes, vals, judge):
            return [], "bfloat16", None, True
    return ([module] if module else []), None, None, False


def _higher_scale(fx, nodes):
    """(the GradScaler's scale tensor, a higher scale) for a replay: the power-of-two multiple of the
    step's scale that puts the largest finite backward value's shadow at 2^14..2^15 (below float16's
    max 65504, as a GradScaler's growth would leave it); None without a GradScaler or when that is no
    higher than the step's own scale."""
    st = fx.scale_tensor() if fx.scale_tensor is not None else None
    if st is None or not float(st) > 0:
        return None
    top = 0.0
    for n in nodes:
        if n.phase == "backward":
            for sh in n.shadows:
                if isinstance(sh, torch.Tensor) and sh.is_floating_point() and sh.numel():
                    top = max(top, float(sh.abs().nan_to_num(0.0, 0.0, 0.0).max()))
    if not top > 0:
        return None
    k = math.floor(math.log2(2.0**15 / top))
    return (st, float(st) * 2.0**k) if k >= 1 else None


# --------------------------------------------------------------------------- diagnosis
def _diagnose(fx, nodes, spot, step):
    if spot.kind == "loss_scale":
        yield _loss_scale_row(spot, step)
        return
    if spot.kind == "scaled_use":
        yield _scaled_use_row(fx, nodes, spot, step)
        return
    chain = [(nodes[spot.seq], spot.index)] if spot.kind in ("decision", "update") else \
        _walk(nodes, spot.seq, spot.index)
    mech, amp, facts = _classify(fx, nodes, chain, spot)
    if mech is None:
        return
    if mech == "overflow" and amp.phase == "backward" and not facts.get("zeroed") and _carries_scale(fx, amp) and \
            facts["shadow_max"] / spot.detail.get("loss_scale", _step_scale(fx)) <= facts["limit"]:
        return  # gradients that fit once unscaled: the GradScaler's probe of its scale, which it skips (or,
        # where the loop never lets it, the loss_scale spot's bookkeeping; not a pole reached by an input
        # that underflowed to 0: no loss scale makes that)
    src, src_rel = _source(nodes, amp)
    if spot.kind == "decision":  # (the rounding that decides is the nearest: the scores' own)
        src = _decision_source(nodes, spot) or src
    module = amp.module
    if spot.kind == "update":  # the owner of the updated tensor ("": the root's own, or outside the model)
        module = spot.detail.get("module", "")
    if mech == "saturation":
        module = facts["function"].module or module
    if mech == "resolution" and "rounded" in facts:  # (the rounding's own module: amp's may not hold it)
        src, module = facts["rounded"], facts["rounded"].module
    if mech == "domain" and "zero_from" in facts and facts["zero_from"].get("leaf"):
        module = facts["zero_from"]["leaf"].rpartition(".")[0] or module
    low = next((a.dtype for n, _ in chain for a in n.flat if isinstance(a, torch.Tensor) and a.dtype in LOW), None)
    fix_modules, fix_dtype, fix_scale, verified = _try_fixes(fx, nodes, spot, module, low, mech, amp,
                                                             _step_function(chain))
    expr = expression(fx, nodes, amp)
    msg, fix = _words(mech, spot, amp, src, facts, expr, fix_modules, fix_dtype, verified, fx, fix_scale)
    value = facts["constant"] if mech == "lost_constant" else spot.value  # (as the op-level lost_constant)
    yield (step, spot.kind, spot.name, module, amp.name, amp.phase, mech, src.name if src is not None else "",
           src.module if src is not None else "", expr, float(value), msg, fix, ",".join(fix_modules),
           fix_dtype or "", math.nan if fix_scale is None else float(fix_scale), bool(verified))


def _carries_scale(fx, node) -> bool:
    """Whether ``node``'s output carries the step's loss scale: it is fed by the backward of
    ``scaler.scale(loss)`` (a value from saved activations alone, as ``x ** -1.5`` in rsqrt's backward,
    does not, whatever the scale). Unknown (no GradScaler tensor seen): assumed to."""
    return fx.scale_tensor is None or fx.scale_tensor() is None or node.scaled is not None


def _step_scale(fx) -> float:
    """The loss scale of the step's backward (1.0 without a GradScaler)."""
    return float(fx.loss_scale())


def _scaled_use_row(fx, nodes, spot, step):
    d = spot.detail
    n = nodes[spot.seq]
    s = d["loss_scale"]
    msg = (f"{n.name} in '{d['module']}' ({d['phase']}) uses a gradient that still carries the loss scale {s:g}: it "
           f"comes from a backward of a value multiplied by the GradScaler's scale (torch.autograd.grad of "
           f"scaler.scale(...)) and was not divided by it (`{expression(fx, nodes, n)}`), so what it computes - a "
           f"gradient penalty, a gradient norm - is off by that factor, and changes whenever the scale does.")
    fix = ("Divide the gradients torch.autograd.grad returns by the scale before using them: "
           "inv = 1.0 / scaler.get_scale(); grads = [g * inv for g in grads] (PyTorch's AMP examples, \"Gradient "
           "penalty\"); then compute the penalty from those.")
    return (step, "loss_scale", spot.name, "", n.name, d["phase"], "loss_scale", "", "", expression(fx, nodes, n),
            float(s), msg, fix, "", "", math.nan, False)


def _loss_scale_row(spot, step):
    d = spot.detail
    f, s = d["factor"], d["loss_scale"]
    net = f * s
    if net < 1:
        msg = (f"The gradients reach optimizer.step() multiplied by {f:g} (1/{1 / f:g}) although the loss was "
               f"{'not scaled' if s == 1 else f'scaled by {s:g}'}: they are divided by a loss scale that was never "
               f"applied, so every update is {1 / net:g}x too small (all {d['params']} parameters' gradients carry "
               "the same factor).")
        fix = ("Scale the loss by the same factor before backward (scaler.scale(loss) / loss * scale), or disable "
               "the loss scaling (bf16 and fp32 need none): remove the wrapper's unscale of the gradients.")
    else:
        msg = (f"The gradients reach optimizer.step() still multiplied by the loss scale {net:g}: the scale applied "
               f"to the loss was never removed (no unscale_), so every update is {net:g}x too large.")
        fix = "Call scaler.unscale_(optimizer) (or scaler.step(optimizer)) before the step, and scaler.update() after."
    return (step, "loss_scale", "", "", "", "optimizer", "loss_scale", "", "", "", float(net), msg, fix, "", "", math.nan,
            False)


def _fmt(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def _update_words(mech, spot, amp) -> str:
    """The message of an in-place update whose increments are lost: swamping or underflow."""
    d = spot.detail
    if mech == "underflow":
        return (f"{amp.name} updates {spot.name} ({d['dtype']}) in place ({amp.phase}) but {d['lost']} of its "
                f"{d['meant']} increments are lost: they are below {d['dtype']}'s least subnormal "
                f"{d['least']:.3g} (the median increment is {d['median_step']:.2g}), so they round to 0 even "
                f"where the value is 0 (the median value is {d['median_value']:.2g}).")
    return (f"{amp.name} updates {spot.name} ({d['dtype']}) in place ({amp.phase}) but {d['lost']} of its "
            f"{d['meant']} increments round away: the values stay unchanged (a + b == a with b != 0). The "
            f"median increment {d['median_step']:.2g} is below half an ulp of the median value "
            f"{d['median_value']:.2g} in {d['dtype']} (its resolution there is about "
            f"{d['median_value'] * FORMATS[d['dtype']].eps:.2g}).")


def _periodic_words(where, facts, expr, src_txt, spot_txt):
    """(message, code change) of resolution at a periodic function (:func:`_periodic_facts`)."""
    msg = (f"{where} takes arguments up to {facts['x_max']:.4g} that carry an absolute error up to "
           f"{facts['abs_err']:.2g} (a relative error of only {facts['rel_err']:.2g}): a periodic function reads "
           f"the argument's absolute error, so its output is wrong where the format's spacing at that magnitude "
           f"is a sizeable part of the period (`{expr}`){'' if 'rounded' in facts else src_txt}; {spot_txt}.")
    if "rounded" in facts:
        msg += (f" The argument is made from values rounded to {facts['dtype']} by {facts['rounded'].name} in "
                f"'{facts['rounded'].module}' ({facts['rounded'].phase}): up to {facts['rounded_max']:.4g}, where "
                f"{facts['dtype']}'s spacing is {facts['spacing']:g}.")
    return msg, ("compute the argument in float32 from float32 inputs (keep timesteps or positions in float32, "
                 "and the product before sin/cos out of autocast)")


def _words(mech, spot, amp, src, facts, expr, fix_modules, fix_dtype, verified, fx, fix_scale=None):
    where = f"{amp.name} in '{amp.module}' ({amp.phase})"
    spot_txt = _spot_text(spot)
    src_txt = (f"; the rounding it amplifies enters at {src.name} in '{src.module}' ({src.phase})"
               if src is not None and src is not amp else "")
    if mech in ("swamping", "underflow") and spot.kind == "update":
        msg = _update_words(mech, spot, amp)
        if amp.phase == "optimizer":
            code = ("keep the parameters and the optimizer state in float32 (master weights) and let autocast "
                    "compute in 16 bits")
        elif spot.name.startswith("<"):
            code = "keep that running copy (an EMA of the weights, a metric) in float32"
        else:
            code = f"keep '{spot.name}' (and the module's other parameters and buffers) in float32"
    elif mech == "saturation":
        m = facts["function"]
        then = (f"{facts['pole'].name} then meets its pole (1 - y is exactly 0)" if "pole" in facts else
                f"{where} then computes from the rounded value "
                f"({BACKWARD_AT_ASYMPTOTE.get(m.packet, 'its derivative there is 0')})")
        msg = (f"{m.name} in '{m.module}' ({m.phase}) saturates: {facts['count']} of {facts['numel']} outputs round "
               f"to exactly {facts['asymptote']:g} in {dtype_name(m.outs[0].dtype)} where the higher-precision value "
               f"does not; {then}: {spot_txt}.")
        code = (f"compute {m.packet.strip('_')} in float32, or work on the logits (log_sigmoid, BCEWithLogits, "
                "cross_entropy)")
    elif mech == "domain":
        z = facts.get("zero_from")
        c = facts.get("cancellation")
        msg = f"{where} returns {facts.get('count', 0)} non-finite values from finite inputs (`{expr}`)"
        if z is not None:
            leaf = z.get("leaf")
            what = "0/0 - the divisor" if amp.packet.startswith("div") else f"{amp.packet.strip('_')}(0) - its argument"
            msg += (f": {what} `1 - a` is exactly 0 on {z['zeros']} of {z['numel']} elements because a "
                    f"rounds onto 1.0 in {z.get('dtype', '16-bit')}")
            if leaf:
                tens = z.get("leaf_tensor")
                ones = int((tens == 1).sum()) if isinstance(tens, torch.Tensor) else 0
                msg += (f" (the buffer {leaf} is stored in {z['leaf_dtype']} and holds exactly 1.0 at {ones} entries: "
                        f"{z['leaf_dtype']}'s spacing just below 1.0 is "
                        f"{FORMATS[z['leaf_dtype']].eps / 2:.2g}, so values within {FORMATS[z['leaf_dtype']].eps / 4:.2g} "
                        "of 1 round to 1.0)")
        elif c is not None:
            msg += (f": its input went negative ({facts.get('negative', 0)} elements, min {facts.get('x_min', 0):.3g}) "
                    f"where float64 stays non-negative (min {facts.get('shadow_min', 0):.3g}) - a cancellation in "
                    f"{c['op'].name}, a difference of terms up to {c['terms']:.3g} whose rounding error exceeds the "
                    f"true result")
        elif facts.get("negative"):
            msg += f": {facts['negative']} inputs are negative"
        elif facts.get("zero"):
            msg += f": {facts['zero']} inputs are exactly 0 (a pole)"
        msg += src_txt + "."
        code = ("clamp the input at 0 (or compute the difference directly, e.g. (z - p)^2) and keep the computation "
                "in float32") if c is not None else "keep the values feeding it (and the buffers they come from) in float32"
    elif mech == "lost_constant":
        n = facts["op"]
        msg = (f"{where} is wrong on {facts.get('count', 0)} values (`{expr}`): the constant "
               f"{facts['constant']!r} of {n.name} in '{n.module}' is {facts['rounded']:g} in {facts['dtype']} - it "
               f"rounds onto the value it was meant to keep away from, so the pole is reached{src_txt}.")
        code = (f"use a constant {facts['dtype']} can hold (its spacing near 1 is {FORMATS[facts['dtype']].eps:.2g}), "
                "or keep this computation in float32")
    elif mech == "decision_flip":
        msg = (f"{where} decides differently from higher precision on {round(spot.value * spot.detail['numel'])} of "
               f"{spot.detail['numel']} outputs (`{expr}`): its inputs' "
               f"rounding reorders nearly tied values{src_txt}.")
        code = "compute the scores that decide (argmax, top-k, sort, comparisons) in float32"
    elif mech == "resolution" and spot.kind == "decision":
        n = round(spot.value * spot.detail["numel"])
        msg = (f"{where} turns {facts['dtype']} values up to {facts['top']:g} into integers (`{expr}`), but "
               f"{facts['dtype']} holds integers exactly only up to {facts['limit']:g} (2^"
               f"{FORMATS[facts['dtype']].mantissa_bits + 1}): {n} of {spot.detail['numel']} of the integers differ from "
               f"those of the higher-precision values (indices collide){src_txt}.")
        code = "compute the index in float32 or in integers before the cast"
    elif mech == "resolution" and "abs_err" in facts:
        msg, code = _periodic_words(where, facts, expr, src_txt, spot_txt)
    elif mech == "resolution":
        d = spot.detail
        msg = (f"{amp.name} updates {spot.name} ({d['dtype']}) in place ({amp.phase}) with integer increments, but "
               f"{d['lost']} of {d['meant']} are lost: the value {d['median_value']:g} is past the largest integer "
               f"{d['dtype']} counts exactly (2^{FORMATS[d['dtype']].mantissa_bits + 1}), so a counter stops.")
        code = f"keep '{spot.name}' in float32 (or as an integer tensor)"
    elif mech in ("overflow", "underflow"):
        msg, code = _range_words(mech, where, amp, facts, spot_txt, src_txt)
    else:
        neg = ""
        if facts.get("out_min", 0) < 0 <= facts.get("shadow_min", -1):
            neg = (f"; the result goes negative (min {facts['out_min']:.3g}) where float64 stays non-negative "
                   f"(min {facts['shadow_min']:.3g})")
        msg = (f"{where} computes a difference of nearly equal values (terms up to {facts.get('terms', math.nan):.3g}) "
               f"whose rounding error exceeds the result (cancellation){neg}: {spot_txt}{src_txt}.")
        spot_op = spot.name.split(".")[1] if spot.name.startswith("aten.") else ""
        code = ("clamp the difference at 0 before the " + spot_op + ", or compute it directly (e.g. (z - p)^2), "
                "in float32") if neg and spot_op in ("sqrt", "rsqrt", "log", "pow") else \
            "reorder the formula to avoid subtracting nearly equal values, or keep it in float32"
    return msg, _fix_text(mech, amp, fix_modules, fix_dtype, verified, code, fix_scale, spot.kind == "update")


def _range_words(mech, where, amp, facts, spot_txt, src_txt="") -> tuple[str, str]:
    """Message and code change of an overflow or underflow (in communication: a 16-bit sum or cast)."""
    if amp.phase == "communication":
        how = ("the ranks' values are summed in that format (this rank's value times the group size is up to "
               f"{facts['shadow_max']:.3g}" if collective(amp.func) else
               f"the communication hook casts the gradients to it (float64 magnitude up to {facts['shadow_max']:.3g}")
        msg = (f"{where} {'overflows' if mech == 'overflow' else 'underflows to zero'} in "
               f"{dtype_name(amp.outs[0].dtype)}: {how}, {'above' if mech == 'overflow' else 'below'} the format's "
               f"limit {facts['limit']:.3g}); {spot_txt}.")
        return msg, ("communicate the gradients in float32 or bfloat16 (e.g. DDP's bf16_compress_hook), or divide "
                     "them by the group size before casting and reducing rather than after")
    pole = (f" Its input is exactly 0 on {facts['zeroed']} elements where float64 is not - an underflow onto "
            f"{amp.packet.strip('_')}'s pole, so no loss scale can help{src_txt}." if facts.get("zeroed") else "")
    msg = (f"{where} {'overflows' if mech == 'overflow' else 'underflows to zero'}: {facts['count']} values whose "
           f"float64 magnitude is {facts['shadow_max']:.3g} ({'above' if mech == 'overflow' else 'below'} the "
           f"format's limit {facts['limit']:.3g}); {spot_txt}.{pole}")
    return msg, "keep this computation in float32 or rescale it"


def _fix_text(mech, amp, fix_modules, fix_dtype, verified, code, fix_scale=None, update=False) -> str:
    """The finding's fix: the verified config, an unverified one said so, or the code change alone."""
    if verified and fix_scale is not None:
        return (f"Raise the loss scale: torch.amp.GradScaler(init_scale=2**{math.log2(fix_scale):g}) - verified: "
                "replaying this step's backward at that scale leaves none of these gradients flushed to 0.")
    if mech in ("swamping", "underflow") and amp.phase == "optimizer" and update:  # (a counter: its own dtype)
        return ("Keep the parameters and the optimizer state in float32 (master weights: the recommendation's "
                "param_dtype float32) and let autocast compute in 16 bits.")
    if verified and fix_dtype == MASTER_WEIGHTS:
        return ("Keep the parameters and the optimizer state in float32 (master weights: the recommendation's "
                "param_dtype float32) and let autocast compute in 16 bits - verified: replaying this step's "
                f"optimizer math in float32 makes the spot good. Code change: {code}.")
    if verified and fix_modules:
        return (f"Keep {', '.join(repr(m) for m in fix_modules)} in float32 (fp32_modules): verified - replaying "
                f"this step with {'it' if len(fix_modules) == 1 else 'them'} in float32 makes the spot good. "
                f"Code change: {code}.")
    if verified and fix_dtype:
        return f"Use {fix_dtype}: verified by replaying this step in it. Code change: {code}."
    if fix_modules:
        return (f"Keep '{fix_modules[0]}' in float32 (fp32_modules) - not verified: the recording holds only the "
                f"rounded values, so a replay cannot show it. Code change: {code}.")
    return f"No config fixes this; code change: {code}."


def _spot_text(spot) -> str:
    d = spot.detail
    if spot.kind == "gradient":
        return (f"the gradient of {spot.name} is exactly 0 on {d['lost']} of {d['numel']} elements where float64 "
                f"gives a median {d['shadow_median']:.2g}")
    if spot.kind == "nonfinite":
        return f"{d['count']} of {d['numel']} values of {spot.name} are non-finite"
    if spot.kind == "output":
        return (f"the model's output (made by {spot.name}) is off by {spot.value:.2g} (relative L2) against float64, "
                f"{spot.value / d['roundoff']:.0f} times {d['dtype']}'s unit roundoff")
    if spot.kind == "decision":
        n = round(spot.value * spot.detail["numel"])
        return f"{n} of {spot.detail['numel']} of {spot.name}'s decisions ({spot.value:.2g} of them) differ from float64's"
    return spot.kind


__all__ = ["analyse", "frame", "replay", "expression", "bad_fraction", "rel_l2", "set_flips", "COLUMNS", "DOMAIN", "MECHANISMS", "MOVES",
           "MOVING", "WRONG"]
