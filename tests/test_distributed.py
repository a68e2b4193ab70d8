"""Multi-rank recording: two gloo processes (torch.multiprocessing.spawn, file:// rendezvous) run
the scenarios of tests/distributed_worker.py on the demo GPT; the tests check, in this process,
what they recorded against oracles the recorder did not compute: the stats of the concatenated
per-rank tensors, a single-process recording of the concatenated batch, FSDP's own full tensors,
the GradScaler's own found_inf.

One spawn runs every training scenario in sequence (one process start for all of them); the crash
scenario gets its own.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.distributed as dist

import mpscope
from mpscope.recorder import RecorderError
from mpscope.run import RunFileError
from mpscope.stats import tensor_stats

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                       reason="torch.distributed with the gloo backend is not available in this build"),
]

#: Columns compared exactly (counts through their fractions, which are count / numel).
EXACT = ("numel", "min", "max", "absmax", "absmin_nonzero", "zero_frac", "subnormal_frac", "fp16_underflow_frac",
         "fp16_subnormal_frac", "fp16_overflow_frac", "bf16_underflow_frac", "bf16_subnormal_frac",
         "bf16_overflow_frac", "nan_count", "inf_count")


def _spawn(scenario: str) -> Path:
    import distributed_worker as w

    out = Path(tempfile.mkdtemp(prefix=f"mpscope-dist-{scenario}-"))
    torch.multiprocessing.spawn(w.main, args=(2, f"file://{out}/rendezvous", str(out), scenario), nprocs=2, join=True)
    return out


def _statuses(out: Path, scenario: str) -> list[str]:
    return [(out / f"status_{scenario}_{r}.txt").read_text() for r in range(2)]


def _spawned(scenario: str):
    """The scenarios' output directory once both ranks ran them without error (removed afterwards)."""
    out = _spawn(scenario)
    status = _statuses(out, scenario)
    assert status == ["ok", "ok"], "a rank failed:\n" + "\n".join(status)
    yield out
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="module")
def main_out():
    yield from _spawned("main")


def _row(t: pd.DataFrame, step: int, module: str, role: str, name: str) -> pd.Series:
    rows = t[(t.step == step) & (t.module == module) & (t.role == role) & (t["name"] == name)]
    assert len(rows) == 1, f"{len(rows)} rows for step {step} {module!r} {role} {name}"
    return rows.iloc[0]


def _assert_row_is(row: pd.Series, tensor: torch.Tensor, what: str) -> None:
    st = tensor_stats(tensor)
    st["absmax"] = max(abs(st["min"]), abs(st["max"]))
    st["bf16_overflow_frac"] = st.get("bf16_overflow_frac", 0.0)
    for col in EXACT:
        a, b = row[col], st[col]
        assert a == b or (pd.isna(a) and pd.isna(b)), f"{what}: {col} merged {a!r} vs full tensor {b!r}"


def _split(pname: str) -> tuple[str, str]:
    module, _, name = pname.rpartition(".")
    return module, name


def _flat_cat(*tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors if t is not None])


def test_ddp_merged_activations_equal_the_concatenated_batch(main_out):
    merged = mpscope.Run.load(main_out / "ddp")
    t = merged.tensors
    c0, c1 = (torch.load(main_out / f"ddp_caps_{r}.pt") for r in range(2))
    # oracle 1: the stats of the two ranks' own output tensors, concatenated
    assert len(c0["act"]) > 30
    for (module, name), a in c0["act"].items():
        _assert_row_is(_row(t, 0, module, "activation", name), _flat_cat(a, c1["act"][(module, name)]),
                       f"activation {module!r} {name}")
    # oracle 2: one process recording the concatenated global batch (same weights at step 0); the
    # position embedding (the same (seq, d) tensor on every rank) and the loss (a mean per rank)
    # are not batch rows, so they are not the concatenation's
    import distributed_worker as w

    model, data = w.gpt()
    x, y = data.batch(w.GLOBAL_BATCH, data.generator(1000))
    with mpscope.record(model, roles=["activation"]) as rec:
        model(x, y)
        rec.step()
    single = rec.run.tensors
    single = single[~single.module.isin(["pos_emb"]) & ~((single.module == "") & (single["name"] == "output.1"))]
    assert len(single) > 30
    for _, ref in single.iterrows():
        got = _row(t, 0, ref.module, "activation", ref["name"])
        for col in EXACT:
            assert got[col] == ref[col] or (pd.isna(got[col]) and pd.isna(ref[col])), (ref.module, ref["name"], col)


def test_ddp_gradients_local_vs_reduced_and_weights(main_out):
    t = mpscope.Run.load(main_out / "ddp").tensors
    c0, c1 = (torch.load(main_out / f"ddp_caps_{r}.pt") for r in range(2))
    differ = 0
    for pname, g0 in c0["local"].items():
        module, name = _split(pname)
        local = _row(t, 0, module, "param_grad_local", name)
        reduced = _row(t, 0, module, "param_grad", name)
        # local: both ranks' own gradients before the all-reduce; reduced: .grad after it, the same
        # tensor on both ranks (its row is that tensor's, not a sum over ranks)
        _assert_row_is(local, _flat_cat(g0, c1["local"][pname]), f"local grad {pname}")
        assert torch.equal(c0["reduced"][pname], c1["reduced"][pname])
        _assert_row_is(reduced, c0["reduced"][pname], f"reduced grad {pname}")
        _assert_row_is(_row(t, 0, module, "weight", name), c0["weight"][pname], f"weight {pname}")
        differ += (local["min"], local["max"], local["numel"]) != (reduced["min"], reduced["max"], reduced["numel"])
    assert differ == len(c0["local"])
    # names are the user's (no DDP "module." prefix); settings and the merge cost are in meta
    assert not t.module.astype(str).str.startswith("module").any()
    assert c0["exchanges"] == 3 and c0["bytes_sent"] > 0  # two recorded steps and the one at exit


def test_out_dir_per_rank_files_merged_run_and_load(main_out):
    d = main_out / "ddp"
    merged = mpscope.Run.load(d)
    assert merged.ranks == [0, 1] and merged.meta["model"] == "GPT"
    per_rank = [mpscope.Run.load(d, rank=r) for r in range(2)]
    assert [r.ranks for r in per_rank] == [[0], [1]]
    hive = pd.read_parquet(d / "ranks" / "tensors")
    assert sorted(hive["rank"].astype(int).unique()) == [0, 1]
    for r in range(2):
        own = hive[hive["rank"].astype(int) == r]
        assert len(own) == len(per_rank[r].tensors)
    # activations differ between ranks (each its own batch), weights do not
    act = [_row(p.tensors, 0, "blocks.0.mlp.fc", "activation", "output") for p in per_rank]
    assert act[0]["max"] != act[1]["max"]
    assert _row(merged.tensors, 0, "blocks.0.mlp.fc", "activation", "output")["max"] == max(a["max"] for a in act)
    # the per-rank files merged here (as when rank 0 died before writing merged/) equal rank 0's merge
    copy = main_out / "ddp_copy"
    shutil.copytree(d / "ranks", copy / "ranks")
    offline = mpscope.Run.load(copy)
    key = ["step", "module", "role", "name", "dtype"]
    a = merged.tensors.astype({c: str for c in key[1:]}).sort_values(key).reset_index(drop=True)
    b = offline.tensors.astype({c: str for c in key[1:]}).sort_values(key).reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b)
    pd.testing.assert_frame_equal(merged.steps.reset_index(drop=True), offline.steps.reset_index(drop=True))
    with pytest.raises(RunFileError, match="no files of rank 5"):
        mpscope.Run.load(d, rank=5)
    # DDP's replicated rows (weights and all-reduced gradients, the same tensors on every rank) are
    # recorded once, each by one rank, the parameters split by size; the merged Run has them all
    import distributed_worker as w

    sizes = {n: p.numel() for n, p in w.gpt()[0].named_parameters()}
    for role in ("weight", "param_grad"):
        own = [{f"{m}.{n}" for m, n in zip(p.tensors.module[(p.tensors.step == 0) & (p.tensors.role == role)].astype(str),
                                           p.tensors["name"][(p.tensors.step == 0) & (p.tensors.role == role)].astype(str))}
               for p in per_rank]
        assert not own[0] & own[1] and own[0] | own[1] == set(sizes)
        assert abs(sum(sizes[n] for n in own[0]) - sum(sizes[n] for n in own[1])) <= max(sizes.values())
        assert len(merged.tensors[(merged.tensors.step == 0) & (merged.tensors.role == role)]) == len(sizes)


def test_inf_on_one_rank_found_and_named(main_out):
    d = main_out / "inf"
    for r in range(2):  # the GradScaler's own found_inf: both ranks skip step 1 (DDP all-reduced the inf)
        s = mpscope.Run.load(d, rank=r).steps
        assert s.found_inf.tolist() == [False, True, False]
        assert s.skipped.tolist() == [False, True, False]
        assert s.scale_after.tolist() == [65536.0, 32768.0, 32768.0]
        assert not s.clipped_before_unscale.any()  # DDP writing the reduced gradients is no clip
        assert "grads_changed_before_unscale" not in mpscope.Run.load(d, rank=r).meta  # nor a change by hand
    merged = mpscope.Run.load(d)
    assert merged.steps.found_inf.tolist() == [False, True, False]
    own = mpscope.Run.load(d, rank=1).tensors
    bad = own[(own.nan_count + own.inf_count > 0) & (own.role == "activation")]
    first_module = str(bad.iloc[0].module)  # rank 1's own first non-finite activation
    assert first_module.startswith("blocks.0")
    f = [f for f in mpscope.advise(merged).findings if f.code == "first_nonfinite"]
    assert len(f) == 1 and f[0].rank == 1 and f[0].module == first_module and f[0].step == 1
    assert "on rank 1" in f[0].message
    assert not [f for f in mpscope.advise(mpscope.Run.load(d, rank=0)).findings if f.code == "first_nonfinite"]
    own_f = [f for f in mpscope.advise(mpscope.Run.load(d, rank=1)).findings if f.code == "first_nonfinite"]
    assert [(f.rank, f.module) for f in own_f] == [(1, first_module)]
    # rank 1 wrote its rows the moment the inf arrived: the part holding them ends with step 1
    parts = [pd.read_parquet(f) for f in sorted((d / "ranks" / "tensors" / "rank=1").glob("part-*.parquet"))]
    holding = [p for p in parts if ((p.step == 1) & (p.inf_count + p.nan_count > 0)).any()]
    assert len(holding) == 1 and holding[0].step.max() == 1
    nf = merged.tables["nonfinite_ranks"]
    assert set(nf.first_rank[nf.role == "activation"]) == {1}


def test_rank_skipping_a_module_neither_hangs_nor_corrupts(main_out):
    d = main_out / "skip"  # rank 0 never runs `aux`; merged every 2 recorded steps and at exit
    merged, r0, r1 = mpscope.Run.load(d), mpscope.Run.load(d, rank=0), mpscope.Run.load(d, rank=1)
    assert merged.meta["distributed"]["exchanges"] == 2
    assert r0.tensors[(r0.tensors.module == "aux") & (r0.tensors.role == "activation")].empty
    for step in range(3):
        aux = _row(merged.tensors, step, "aux", "activation", "output")
        own = _row(r1.tensors, step, "aux", "activation", "output")
        for col in EXACT:
            assert aux[col] == own[col] or (pd.isna(aux[col]) and pd.isna(own[col])), (step, col)
        fc = [_row(x.tensors, step, "gpt.blocks.1.mlp.fc", "activation", "output") for x in (r0, r1)]
        both = _row(merged.tensors, step, "gpt.blocks.1.mlp.fc", "activation", "output")
        assert both["numel"] == fc[0]["numel"] + fc[1]["numel"]
        assert (both["min"], both["max"]) == (min(f["min"] for f in fc), max(f["max"] for f in fc))
    assert len(merged.steps) == 3


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_fsdp_merged_weights_and_grads_equal_full_tensors(main_out, kind):
    t = mpscope.Run.load(main_out / kind).tensors
    if kind == "fsdp2":  # DTensor.full_tensor(), gathered by FSDP2 itself
        full = torch.load(main_out / "fsdp2_full.pt")
    else:  # each rank's shards of the original parameters (use_orig_params), concatenated
        s0, s1 = (torch.load(main_out / f"fsdp1_shards_{r}.pt") for r in range(2))
        full = {n: (_flat_cat(s0[n][0], s1[n][0]), _flat_cat(s0[n][1], s1[n][1])) for n in s0}
    assert len(full) == 37
    for pname, (w, g) in full.items():
        module, name = _split(pname)
        _assert_row_is(_row(t, 1, module, "weight", name), w, f"{kind} weight {pname}")
        _assert_row_is(_row(t, 1, module, "param_grad", name), g, f"{kind} grad {pname}")
    assert not t.module.astype(str).str.contains("_fsdp_wrapped_module").any()


def test_fsdp1_backward_of_another_model_is_not_the_recorded_models(main_out):
    """FSDP1 with use_orig_params: gradients accumulate into the flat parameters, not the original
    ones. Another model's backward (and an evaluation pass) in each step: each rank's steps hold
    one training backward with the loss that rank backpropagated through the GPT, and the
    training batch's activation rows."""
    for rank in range(2):
        run = mpscope.Run.load(main_out / "fsdp1_two", rank=rank)
        assert run.steps.loss.tolist() == torch.load(main_out / f"fsdp1_two_losses_{rank}.pt")
        assert run.steps.backward_count.tolist() == [1, 1]
        assert "training_backward" not in run.meta  # observed, not assumed
        t = run.tensors
        emb = t[(t.role == "activation") & (t.module == "tok_emb")]
        assert emb.numel.tolist() == [4 * 32 * 32] * 2  # this rank's 4 sequences of 32 tokens, d_model 32


def test_unrecorded_steps_write_two_scalars_and_issue_no_collective(main_out):
    """On the steps ``every=4`` leaves unrecorded, under DDP and FSDP2, mpscope's whole device work
    is two in-place copies per step (the step's loss into its row, and the next step's row opened
    in one copy) plus the views they need: no per-scalar writes, no stats, no host copy, and no
    collective (the ATen ops are attributed to mpscope by the op counter from the Python stack)."""
    views = {"aten.detach", "aten.select", "aten.view", "aten.alias", "aten._unsafe_view"}
    for rank in range(2):
        res = json.loads((main_out / f"idle_steps_{rank}.json").read_text())
        for kind in ("ddp", "fsdp2"):
            got = res[kind]
            assert got["recorded"] == [True, False, False, False, True], (rank, kind)
            assert all(got["loss_known"]), (rank, kind)  # the unrecorded steps' rows are still written
            assert got["collectives"] == [], (rank, kind)
            assert not got["flush"], (rank, kind)
            writes = {op: n for op, n in got["ops"].items() if op not in views}
            assert writes == {"aten.copy_": 2 * 3}, (rank, kind, got["ops"])


def test_scaler_disagreement_across_ranks_is_a_finding(main_out):
    merged = mpscope.Run.load(main_out / "desync")
    d = merged.tables["rank_disagreement"]
    ls = d[d.column == "loss_scale"]
    assert ls.step.tolist() == [0, 1, 2]
    assert (ls["min"].tolist(), ls["max"].tolist()) == ([2.0**10] * 3, [2.0**16] * 3)
    f = [f for f in mpscope.advise(merged).findings if f.code == "scaler_desync"]
    assert len(f) == 1 and f[0].severity == "error" and f[0].step == 0
    # the ranks that agree (the DDP scenario, no scaler) give no such finding
    assert not [f for f in mpscope.advise(mpscope.Run.load(main_out / "inf")).findings if f.code == "scaler_desync"]


def test_ordinary_grad_scaler_skips_under_ddp_are_no_error(main_out):
    """Each rank's own gradients (param_grad_local) hold the inf GradScaler skips for, as the
    reduced ones do: on a skipped step that is the scaler at work, not a first_nonfinite error."""
    merged = mpscope.Run.load(main_out / "skips")
    s, t = merged.steps, merged.tensors
    skipped = s.step[s.skipped & s.found_inf].tolist()
    assert skipped and len(skipped) < len(s)  # backs off, then steps
    local = t[(t.role == "param_grad_local") & (t.inf_count + t.nan_count > 0)]
    assert set(local.step) and set(local.step) <= set(skipped)
    assert [f.code for f in mpscope.advise(merged).findings if f.severity == "error"] == []


def test_one_rank_of_a_merged_run_in_memory_and_loaded(main_out):
    """run.for_rank(N): rank N's own rows, read from the out= directory by a loaded merged Run and
    by recorder.run on rank 0; without out= only rank 0's own are at hand there; bad ranks raise."""
    d = main_out / "ddp"
    hive = pd.read_parquet(d / "ranks" / "tensors")
    per_rank = {r: int((hive["rank"].astype(int) == r).sum()) for r in range(2)}
    c0, c1 = (torch.load(main_out / f"ddp_caps_{r}.pt") for r in range(2))
    assert c0["own_rows"] == per_rank  # recorder.run on rank 0 (the merged Run, in memory)
    merged = mpscope.Run.load(d)
    assert {r: len(merged.for_rank(r).tensors) for r in range(2)} == per_rank
    assert merged.for_rank(1) is merged.for_rank(1) and merged.for_rank(None) is merged
    one = mpscope.Run.load(d, rank=1)
    assert one.for_rank(1) is one
    # recorded without out=: rank 0 holds the merged Run and its own rows, not rank 1's
    assert c0["no_out"]["ranks"] == [0, 1] and c1["no_out"]["ranks"] == [1]
    assert c0["no_out"]["own_rows"] == c1["no_out"]["rows"] > 30  # one row per module output on each rank
    assert "recorded without out=" in c0["no_out"]["other"] and "ranks at hand here: [0]" in c0["no_out"]["other"]
    assert "is not one of them" in c1["no_out"]["other"]
    # a merged Run saved elsewhere has no directory of per-rank rows
    with pytest.raises(ValueError, match=r"record\(\.\.\., out=DIR\)"):
        mpscope.Run.load(d / "merged").for_rank(1)
    with pytest.raises(ValueError, match=r"ranks \[0, 1\]; rank 5 is not one of them"):
        merged.for_rank(5)
    for bad in ("1", True, 1.0):
        with pytest.raises(TypeError, match="rank must be an int"):
            merged.for_rank(bad)


def test_explorer_rank_control_shows_each_ranks_rows(main_out):
    """The explorer of a merged Run: a rank dropdown whose rank N shows rank N's own rows (oracle:
    that rank's captured module outputs), the first NaN / inf's rank with a button opening it, and
    a clear message for a rank whose rows are not at hand."""
    pytest.importorskip("ipywidgets")
    pytest.importorskip("altair")
    import html
    import math

    d = main_out / "ddp"
    c0, c1 = (torch.load(main_out / f"ddp_caps_{r}.pt") for r in range(2))
    e = mpscope.explore(mpscope.Run.load(d))
    assert e.rank_box.layout.display == "flex" and e.rank_choice.options == (("merged", None), ("rank 0", 0), ("rank 1", 1))
    assert e.rank_jump.layout.display == "none"  # no rank saw NaN / inf
    assert "merged over 2 ranks (0, 1)" in e.title.value

    def cells() -> pd.Series:
        e.role.value, e.statistic.value, e.module_filter.value = "activation", "log2_absmax", ""
        return e.cells.set_index(["module", "step"])["value"]

    fc = ("blocks.0.mlp.fc", "output")
    both = max(c0["act"][fc].abs().max().item(), c1["act"][fc].abs().max().item())
    assert cells()[(fc[0], 0)] == pytest.approx(math.log2(both), abs=1e-12)
    for r, caps in ((1, c1), (0, c0)):
        e.rank_choice.value = r
        assert e.run.ranks == [r] and f"rank {r}'s own rows (of 2 ranks)" in html.unescape(e.title.value)
        assert cells()[(fc[0], 0)] == pytest.approx(math.log2(caps["act"][fc].abs().max().item()), abs=1e-12)
        e.select(fc[0], 0)
        assert e.band_data.set_index("step_lo").loc[0, "max"] == caps["act"][fc].max().item()
    e.rank_choice.value = None
    assert e.run is e.merged_run and cells()[(fc[0], 0)] == pytest.approx(math.log2(both), abs=1e-12)
    assert e.advice is not None

    # the inf injected on rank 1: the note names rank 1 and the module; the button opens rank 1
    inf = mpscope.Run.load(main_out / "inf")
    own = mpscope.Run.load(main_out / "inf", rank=1).tensors
    first = str(own[(own.nan_count + own.inf_count > 0) & (own.role == "activation")].iloc[0].module)
    e = mpscope.explore(inf)
    assert "first on <b>rank 1</b>" in e.rank_note.value and f"<code>{first}</code>" in e.rank_note.value
    assert "at step 1" in e.rank_note.value
    assert e.rank_jump.layout.display == "flex" and e.rank_jump.description == "open rank 1"
    e.rank_jump.click()
    assert e.rank_choice.value == 1 and e.run.ranks == [1] and e.rank_jump.layout.display == "none"
    assert len(e.run.tensors) == len(own)
    assert [(f.rank, f.module) for f in e.advice.findings if f.code == "first_nonfinite"] == [(1, first)]
    assert "rank 1" in e.recommendation.value

    # opened on one rank; a merged Run without its directory keeps the view and says why
    assert mpscope.explore(inf, rank=0).run.ranks == [0]
    e = mpscope.explore(mpscope.Run.load(d / "merged"))
    e.rank_choice.value = 1
    assert e.rank_choice.value is None and e.run is e.merged_run
    assert "rank 1:" in e.rank_note.value and "out=DIR" in e.rank_note.value
    with pytest.raises(ValueError, match="rank 5 is not one of them"):
        mpscope.explore(inf, rank=5)
    with pytest.raises(TypeError, match="rank must be an int"):
        mpscope.explore(inf, rank="1")


def test_report_advisor_compare_and_cli_filter_one_rank(main_out, tmp_path):
    """report / advise / compare / the CLI take rank=N: the rows they read are rank N's own."""
    from mpscope.cli import main as cli

    d = main_out / "inf"
    merged, r1 = mpscope.Run.load(d), mpscope.Run.load(d, rank=1)
    text = merged.report(tmp_path / "merged.html").read_text()
    assert "<h2>Ranks</h2>" in text and "merged over 2 ranks (0, 1)" in text
    assert "<th>first rank</th>" in text and "<th>rank</th>" in text  # the findings table names the rank
    nf = merged.tables["nonfinite_ranks"]
    first = nf.sort_values("step", kind="stable").iloc[0]
    assert first.first_rank == 1 and f"<td>{int(first.step)}</td><td><code>{first.module}</code></td>" in text
    one = merged.report(tmp_path / "r1.html", rank=1).read_text()
    assert "rank 1&#x27;s own rows (of 2 ranks)" in one and "<h2>Ranks</h2>" not in one
    assert f"{len(r1.tensors):,} tensor rows" in one
    # the advisor on one rank = the advisor on that rank's Run
    codes = lambda a: [(f.code, f.module, f.step, f.rank) for f in a.findings]
    assert codes(mpscope.advise(merged, rank=1)) == codes(mpscope.advise(r1))
    assert ("first_nonfinite", str(own_first(r1)), 1, 1) in codes(mpscope.advise(merged, rank=1))
    # compare: rank 1 of the merged run against rank 1's own Run matches row for row; the merged
    # rows against rank 1's differ where the ranks' batches differ (activations)
    same = mpscope.compare(merged, r1, rank=1)
    assert not same.diverged and len(same.divergence) == len(r1.tensors) and same.only_a == same.only_b == 0
    across = mpscope.compare(merged, r1, roles=["activation"])
    assert len(across.divergence) == len(r1.tensors[r1.tensors.role == "activation"])
    a, b = across.divergence.absmax_a, across.divergence.absmax_b
    assert ((a >= b) | a.isna() | b.isna()).all() and (a > b).any()  # the merged max covers rank 0's batch too
    with pytest.raises(ValueError, match="rank 0 is not one of them"):
        mpscope.compare(merged, r1, rank=0)
    # the CLI: --rank N, and a clear one-line error for a rank the directory does not have
    assert cli(["report", str(d), "--rank", "1", "-o", str(tmp_path / "cli.html")]) == 0
    assert "rank 1&#x27;s own rows" in (tmp_path / "cli.html").read_text()
    assert cli(["advise", str(d), "--rank", "7"]) == 2


def own_first(run) -> str:
    t = run.tensors
    return t[(t.nan_count + t.inf_count > 0) & (t.role == "activation")].iloc[0].module


def test_per_rank_files_complete_after_a_rank_raises_mid_step():
    out = _spawn("crash")
    try:
        status = _statuses(out, "crash")
        assert "rank 1 fails mid-step" in status[1], status[1]
        assert "Connection closed" in status[0], status[0]  # rank 0 cannot finish step 2's all-reduce
        d = out / "crash"
        assert not (d / "merged").exists()
        own = [mpscope.Run.load(d, rank=r) for r in range(2)]
        for run in own:  # steps 0 and 1 whole, step 2 up to where it stopped (its forward)
            assert run.steps.step.tolist() == [0, 1, 2]
            t = run.tensors
            assert set(t[t.step < 2].role) >= {"activation", "activation_grad", "param_grad", "weight"}
            assert len(t[(t.step == 2) & (t.role == "activation")]) == len(t[(t.step == 0) & (t.role == "activation")])
        merged = mpscope.Run.load(d)  # merged here from the per-rank files
        assert merged.ranks == [0, 1]
        a = [_row(r.tensors, 2, "blocks.0.mlp.fc", "activation", "output") for r in own]
        m = _row(merged.tensors, 2, "blocks.0.mlp.fc", "activation", "output")
        assert m["numel"] == a[0]["numel"] + a[1]["numel"] and m["max"] == max(x["max"] for x in a)
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="module")
def uneven_out():
    yield from _spawned("uneven")


#: scenario -> per rank: (the steps its own Run holds, or None where it does not record; the
#: warning mpscope gives it, or None)
UNEVEN = {
    "only0": (([0, 1, 2, 3], "of the group [0, 1] did not start recording within 4 s"), (None, None)),
    "every": (([0, 1, 2, 3], "different settings"), ([0, 1, 2, 3], "different settings")),
    "leaves": (([0, 1, 2, 3], "another rank's recording ended"), ([0, 1], "did not end their recording")),
    "raises": (([0, 1, 2, 3], "another rank's recording ended"), ([0, 1], None)),
    "fsdp2_only1": ((None, None), ([0, 1, 2, 3], "of the group [0, 1] did not start recording within 4 s")),
    "nogroup": (([0, 1, 2, 3], None), ([0, 1, 2, 3], None)),
    "late": (([0, 1, 2, 3], "of the group [0, 1] did not start recording within 4 s"),
             ([0, 1, 2, 3], "rank(s) [0] started recording alone before this rank called record()")),
}


@pytest.mark.parametrize("name", list(UNEVEN))
def test_ranks_recording_unevenly_finish_within_the_bound_train_alike_and_keep_their_rows(uneven_out, name):
    """MPSCOPE_DIST_TIMEOUT=4 in the ranks: no wait is longer; each rank trains to the weights of
    the same loop without mpscope and keeps the rows of the steps it recorded, its own only."""
    for r, (steps, warned) in enumerate(UNEVEN[name]):
        got = torch.load(uneven_out / f"{name}_{r}.pt")
        rec, plain = got["recorded"], got["plain"]
        assert rec["weights"].keys() == plain["weights"].keys()
        assert all(torch.equal(rec["weights"][k], plain["weights"][k]) for k in plain["weights"]), (name, r)
        assert rec["seconds"] < 4 + 25, (name, r, rec["seconds"])  # one bounded wait, and 8 tiny steps
        assert rec["own_steps"] == steps and rec["steps"] == steps
        if steps is not None:
            assert rec["ranks"] == [r]  # recorder.run is the rank's own Run
            loaded = mpscope.Run.load(uneven_out / name, rank=r)
            assert loaded.steps.step.tolist() == steps and loaded.ranks == [r]
            every = 1 + r if name == "every" else 1
            t = loaded.tensors
            assert sorted(set(t[t.role == "activation"].step)) == steps[::every]
        assert len(rec["warnings"]) == (1 if warned else 0), (name, r, rec["warnings"])
        assert warned is None or warned in rec["warnings"][0], (name, r, rec["warnings"])


def test_a_late_rank_records_alone_at_once(uneven_out):
    late = torch.load(uneven_out / "late_1.pt")["recorded"]
    assert late["attach_seconds"] < 2  # no second wait: rank 0 records alone already


def test_ranks_with_group_false_share_an_out_dir_under_their_own_numbers(uneven_out):
    run = mpscope.Run.load(uneven_out / "nogroup")  # merged here from both ranks' files
    assert run.ranks == [0, 1] and not (uneven_out / "nogroup" / "merged").exists()
    own = [mpscope.Run.load(uneven_out / "nogroup", rank=r) for r in range(2)]
    m = _row(run.tensors, 3, "blocks.0.mlp.fc", "activation", "output")
    a = [_row(o.tensors, 3, "blocks.0.mlp.fc", "activation", "output") for o in own]
    assert m["numel"] == a[0]["numel"] + a[1]["numel"] and m["max"] == max(x["max"] for x in a)


@pytest.mark.parametrize("name", ["leaves", "raises"])
def test_after_merging_stops_a_ddp_rank_records_every_parameter(uneven_out, name):
    """Under DDP each rank records its share of the replicated rows while the ranks merge; rank 0,
    merging no more from step 2 on, records every parameter's weight and gradient."""
    own = [mpscope.Run.load(uneven_out / name, rank=r).tensors for r in range(2)]
    names = lambda t, step, role: set(zip(t[(t.step == step) & (t.role == role)].module.astype(str),
                                          t[(t.step == step) & (t.role == role)]["name"].astype(str)))
    every = names(own[0], 0, "weight") | names(own[1], 0, "weight")
    assert names(own[0], 0, "weight") < every  # a share while merging
    for step in (2, 3):
        assert names(own[0], step, "weight") == every and names(own[0], step, "param_grad") == every


def test_a_merge_of_per_rank_files_names_the_ranks_that_wrote_none(uneven_out):
    with pytest.warns(RuntimeWarning, match=r"rank\(s\) \[1\] of the job wrote no files"):
        run = mpscope.Run.load(uneven_out / "only0")
    assert run.ranks == [0]
    assert run.steps.step.tolist() == mpscope.Run.load(uneven_out / "only0", rank=0).steps.step.tolist()


def test_ranks_merge_again_after_uneven_recordings_in_the_same_processes(uneven_out):
    got = [torch.load(uneven_out / f"both_{r}.pt")["recorded"] for r in range(2)]
    assert got[0]["ranks"] == [0, 1] and got[1]["ranks"] == [1]  # rank 0 holds the merged Run
    assert got[0]["warnings"] == got[1]["warnings"] == []
    merged = mpscope.Run.load(uneven_out / "both")
    own = [mpscope.Run.load(uneven_out / "both", rank=r) for r in range(2)]
    m = _row(merged.tensors, 3, "blocks.0.mlp.fc", "activation", "output")
    a = [_row(o.tensors, 3, "blocks.0.mlp.fc", "activation", "output") for o in own]
    assert m["numel"] == a[0]["numel"] + a[1]["numel"] and m["max"] == max(x["max"] for x in a)


def test_a_taken_out_sends_every_rank_to_the_same_sibling(uneven_out):
    """A second recording into the out= of a finished one goes to out-1 on every rank, merged."""
    got = [torch.load(uneven_out / f"again_{r}.pt")["recorded"] for r in range(2)]
    assert got[0]["ranks"] == [0, 1]
    for g in got:
        assert [w for w in g["warnings"] if "every rank writes to" in w and "both-1" in w]
    merged = mpscope.Run.load(uneven_out / "both-1")
    assert merged.ranks == [0, 1] and merged.steps.step.tolist() == [0, 1, 2, 3]
    assert mpscope.Run.load(uneven_out / "both").steps.step.tolist() == [0, 1, 2, 3]  # the first one untouched


def test_merge_blocks_equal_concatenation_single_process():
    """The pure merge (pack, element-wise SUM / MIN, unpack) of three 'ranks' equals the stats of
    the concatenated tensors, including a key only one rank has and one with NaN / inf."""
    from mpscope import merge
    from mpscope.run import STEP_COLUMNS, Run
    from mpscope.stats import COUNT_NAMES, device_stats, histogram_rows, host_rows, EXP_MIN

    g = torch.Generator().manual_seed(0)
    parts = {("a", "activation", "output", "float16"): [torch.randn(50, generator=g).half() * 1e-4 for _ in range(3)],
             ("b", "activation", "output", "float32"): [torch.randn(40, generator=g) * 1e5 for _ in range(3)]}
    parts[("b", "activation", "output", "float32")][2][3] = float("inf")
    parts[("c", "activation", "output", "float32")] = [None, torch.randn(7, generator=g), None]
    keys = list(parts)
    blocks, hists = [], []
    for rank in range(3):
        have = [(i, ts[rank]) for i, ts in enumerate(parts.values()) if ts[rank] is not None]
        ds = device_stats([t for _, t in have])
        rows = host_rows(ds.counts.numpy(), ds.extrema.numpy())
        cols = {"step": np.zeros(len(have), np.int64), "key": np.array([i for i, _ in have]),
                "numel": np.array([t.numel() for _, t in have]), "min": rows["min"], "max": rows["max"],
                "absmin_nonzero": rows["absmin_nonzero"], "loss_scale": np.ones(len(have))}
        cols.update({f"{n}_count": rows[f"{n}_count"] for n in COUNT_NAMES})
        h = histogram_rows(ds.counts.numpy())
        r, e = np.nonzero(h)
        hist = {"step": np.zeros(len(r), np.int64), "key": cols["key"][r], "exponent": e + EXP_MIN, "count": h[r, e]}
        hists.append(hist)
        step = dict.fromkeys(STEP_COLUMNS, False) | {"step": 0, "loss": 1.0 + rank, "loss_scale": 1.0, "scale_after": 1.0,
                                                     "recorded": True, "backward_count": 1, "clip_norm": float("nan")}
        blocks.append((cols, hist, [tuple(step[c] for c in STEP_COLUMNS)]))
    lo, hi = merge.hist_range(hists, (0,))
    w = merge.Window((0,), 0, 0, len(keys), lo, hi, tuple(STEP_COLUMNS))
    rep = np.zeros(len(keys), bool)
    packed = [merge.pack(w, [c], [h], s, np.arange(len(keys)), rep, rank) for rank, (c, h, s) in enumerate(blocks)]
    m = merge.unpack(w, *merge.reduce_blocks(packed), rep)
    run = Run()
    run.builder().append_merged(m, keys)
    t = run.tensors
    for (module, role, name, _), ts in parts.items():
        full = torch.cat([x for x in ts if x is not None])
        _assert_row_is(_row(t, 0, module, role, name), full, module)
        hist = run.histograms
        got = hist[(hist.module == module)].set_index("exponent")["count"].to_dict()
        assert got == tensor_stats(full)["histogram"]
    assert run.steps.loss.tolist() == [2.0]  # the mean of the ranks' losses
    nf = run.tables["nonfinite_ranks"]
    assert nf[["module", "first_rank", "ranks"]].values.tolist() == [["b", 2, 1]]


def test_wrapper_prefixes_left_out_of_names():
    """Checkpoint and torch.compile wrappers (a second member of the DDP / FSDP1 kind) add no name."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from mpscope.compiled import modules as named_modules

    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    expected = [n for n, _ in plain.named_modules()]
    wrapped = torch.nn.Sequential(plain[0], checkpoint_wrapper(plain[1]))
    compiled = torch.compile(wrapped)
    assert "_orig_mod.1._checkpoint_wrapped_module.0" in [n for n, _ in compiled.named_modules()]
    assert [n for n, _ in named_modules(compiled)] == expected
    # a user's own attribute called "module" is a name, not a wrapper
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = torch.nn.Linear(2, 2)

    assert [n for n, _ in named_modules(Holder())] == ["", "module"]


def test_group_without_torch_distributed_is_a_clear_error():
    assert not dist.is_initialized()
    with pytest.raises(RecorderError, match="init_process_group"):
        mpscope.record(torch.nn.Linear(2, 2), group=object())
    with pytest.raises(RecorderError, match="reduce_every"):
        mpscope.record(torch.nn.Linear(2, 2), reduce_every=0)


def test_out_dir_of_a_single_process_run(tmp_path):
    """Without torch.distributed, out= still writes rank 0's parts and the (trivially merged) Run."""
    import distributed_worker as w

    model, data = w.gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with mpscope.record(model, optimizer=opt, out=tmp_path / "x", roles=["activation", "param_grad"]) as rec:
        for step in range(2):
            x, y = data.batch(4, data.generator(step))
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
    assert rec.run is rec.local_run and rec.run.ranks == [0]
    key = ["step", "module", "role", "name", "dtype"]
    mine = rec.run.tensors.astype({c: str for c in key[1:]}).sort_values(key).reset_index(drop=True)
    for loaded in (mpscope.Run.load(tmp_path / "x"), mpscope.Run.load(tmp_path / "x", rank=0)):
        got = loaded.tensors.astype({c: str for c in key[1:]}).sort_values(key).reset_index(drop=True)
        pd.testing.assert_frame_equal(mine, got)
    with pytest.warns(RuntimeWarning, match="already holds rows of another recording"):
        with mpscope.record(model, optimizer=opt, out=tmp_path / "x") as again:
            pass
    assert again.run.ranks == [0] and (tmp_path / "x-1" / "ranks").is_dir()
