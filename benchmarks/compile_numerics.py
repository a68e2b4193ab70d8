"""Does recording change training under torch.compile's inductor backend, and by how much next to
inductor's own differences?

Run ``python benchmarks/compile_numerics.py`` (a few minutes on a 2-core CPU, most of it compiling)
or ``--steps 5`` for a shorter run.

Method. The demo's small GPT (d_model 128, 2 layers, 4 heads, sequence 64, batch 8, dropout 0,
Python's standard-library source) under CPU autocast bfloat16 with AdamW (lr 1e-3), trained
``--steps`` steps from one ``state_dict`` on the same batches in each variant, each variant compiled
afresh (``torch._dynamo.reset()``):

* ``eager``: no compile;
* ``ind``: ``torch.compile(model)`` (inductor, default settings), unrecorded;
* ``ind_again``: the same, compiled again with inductor's FX graph cache off (run-to-run);
* ``ind_fusion``: unrecorded, with another valid fusion heuristic (``realize_reads_threshold=1``:
  inductor stores more intermediates instead of recomputing them in their consumers);
* ``ind_rec``: ``mpscope.record(compiled, optimizer=opt)``, every step recorded;
* ``emul`` / ``emul_rec``: unrecorded / recorded with ``emulate_precision_casts=True`` (bf16
  intermediates inside fused kernels rounded as eager rounds them);
* ``scalar`` / ``scalar_rec``: unrecorded / recorded with ``emulate_precision_casts=True`` and
  ``cpp.simdlen=1`` (scalar kernels: one summation order whatever is fused), one thread (the
  compiled embedding backward adds with atomics, so more threads differ run to run).

For each pair the report gives the first step's loss difference, the first step's parameter
gradients' difference ``||g_a - g_b|| / ||g_b||`` (norm over all parameters: before the optimizer
amplifies anything), the weights' difference after the last step ``||w_a - w_b|| / ||w_b||``, the
largest per-tensor ``max|w_a - w_b| / max|w_b|`` with its tensor, and whether the weights are
bitwise equal. The last line is a JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch._dynamo as dynamo
import torch._inductor.config as icfg

import mpscope

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_overhead import demo_gpt  # noqa: E402

EMUL = {"emulate_precision_casts": True}
SCALAR = {"emulate_precision_casts": True, "cpp.simdlen": 1}
# name: (compiled, recorded, inductor settings, threads)
VARIANTS = {
    "eager": (False, False, {}, None),
    "ind": (True, False, {}, None),
    "ind_again": (True, False, {"fx_graph_cache": False}, None),
    "ind_fusion": (True, False, {"realize_reads_threshold": 1}, None),
    "ind_rec": (True, True, {}, None),
    "emul": (True, False, EMUL, None),
    "emul_rec": (True, True, EMUL, None),
    "scalar": (True, False, SCALAR, 1),
    "scalar_rec": (True, True, SCALAR, 1),
}
PAIRS = [("ind_again", "ind", "inductor run to run (recompiled)"),
         ("ind_fusion", "ind", "inductor, another fusion heuristic"),
         ("ind", "eager", "inductor vs eager"),
         ("ind_rec", "ind", "RECORDED vs unrecorded (defaults)"),
         ("ind_rec", "eager", "recorded inductor vs eager"),
         ("emul", "eager", "emulate_precision_casts vs eager"),
         ("emul_rec", "emul", "RECORDED vs unrecorded (emulate_precision_casts)"),
         ("scalar_rec", "scalar", "RECORDED vs unrecorded (emulate + scalar, 1 thread)")]


def _train(base, batches, steps, compiled, recorded, settings, threads):
    dynamo.reset()
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        with icfg.patch(settings):
            model = copy.deepcopy(base)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            run_model = torch.compile(model) if compiled else model
            rec = mpscope.record(run_model, optimizer=opt) if recorded else None
            losses, grads = [], None
            with rec if rec is not None else torch.enable_grad():
                for i in range(steps):
                    x, y = batches[i % len(batches)]
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = run_model(x, y)[1]
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    if grads is None:
                        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
                    opt.step()
                    losses.append(loss.item())
    finally:
        torch.set_num_threads(old_threads)
    return {"losses": losses, "grads": grads, "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def _norm_rel(a: dict, b: dict) -> float:
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def compare(a: dict, b: dict) -> dict:
    wa, wb = a["weights"], b["weights"]
    per = {k: float((wa[k].float() - v.float()).abs().max() / v.float().abs().max().clamp_min(1e-30))
           for k, v in wb.items() if v.is_floating_point()}
    worst = max(per, key=per.get)
    return {"loss_step0": abs(a["losses"][0] - b["losses"][0]), "grad_step0": _norm_rel(a["grads"], b["grads"]),
            "weights": _norm_rel(wa, wb), "tensor_max": per[worst], "tensor": worst,
            "bitwise": all(torch.equal(wa[k], v) for k, v in wb.items())}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="mpscope: .* run inside a torch.compile")
    base, batches = demo_gpt()
    t0 = time.perf_counter()
    runs = {name: _train(base, batches, a.steps, *spec) for name, spec in VARIANTS.items()}
    print(f"torch {torch.__version__}, {a.steps} AdamW steps, {torch.get_num_threads()} threads "
          f"({time.perf_counter() - t0:.0f} s, compiling included)")
    print(f"  {'pair':52s} {'loss0':>9s} {'grad0':>9s} {'weights':>9s} {'tensor max':>10s}  bitwise  (tensor)")
    cmp = {(x, y, label): compare(runs[x], runs[y]) for x, y, label in PAIRS}
    for (_, _, label), c in cmp.items():
        print(f"  {label:52s} {c['loss_step0']:9.2e} {c['grad_step0']:9.2e} {c['weights']:9.2e} "
              f"{c['tensor_max']:10.3g}  {c['bitwise']!s:7s}  ({c['tensor']})")
    result = {"steps": a.steps} | {
        f"{x}/{y}": {k: (v if isinstance(v, (bool, str)) else float(f"{v:.3g}")) for k, v in c.items()}
        for (x, y, _), c in cmp.items()}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
