"""The staged rows (``StagedRows``): on an accelerator each observed tensor is copied into a staging
buffer on its device and the stats are taken in batches. Taken here on the CPU (``stage_cpu``), the
same code a CUDA run takes: rows equal the cast oracle, survive in-place writes after the hook, and a
recording's frames equal the fused kernel's host rows."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

import mpscope
from mpscope import kernel
from mpscope.recording import step_buffer
from mpscope.recording.step_buffer import StagedRows, StepBuffer
from mpscope.stats import COUNT_NAMES
from loops import assert_rows_match_tap, train_with_tap
from test_batch_stats import _check, _values

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.fixture(params=["torch-ops", "kernel"])
def copier(request):
    """The staging copy: torch ops dispatched from Python (no kernel loaded) or the fused kernel's
    ``stage_copy`` (the recorder sets it once the kernel is loaded)."""
    if request.param == "torch-ops":
        return None
    module = kernel.load()
    if module is None:
        pytest.skip("the fused kernel cannot be built here (no C++ compiler / ninja)")
    return module.stage_copy


def _staged(copier, device="cpu", **kwargs) -> StagedRows:
    rows = StagedRows(torch.device(device), **kwargs)
    rows.copier = copier
    return rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hist", [True, False])
def test_staged_rows_match_the_cast_oracle_across_flushes_and_in_place_writes(hist, device, copier):
    """Tensors of every 16/32-bit dtype, 0-dim, non-contiguous and larger than the buffer (its own
    pass), staged into a buffer of 3000 elements (so several batched passes), each overwritten in
    place right after it is staged: every row equals the cast oracle of the values it had."""
    rows = _staged(copier, device, capacity=4, elements=3000)  # (the capacity grows too)
    rows.hist = hist
    base = _values(4096, torch.float32, seed=3).to(device)
    tensors = [_values(n, d, seed=n + i).to(device) for i, d in enumerate(DTYPES) for n in (1, 5, 1000, 2999, 5000)]
    tensors += [_values(1, torch.float16, 9).reshape(()).to(device), base.view(64, 64).t(), base.view(64, 64)[::3, 1::2]]
    # contiguous, with strides of size-1 dimensions that no dense layout has (they are copied in the
    # tensor's own strides), and channels-last (not contiguous: flattened first)
    odd = _values(96, torch.bfloat16, seed=11).to(device)
    tensors += [odd[:64].as_strided((1, 64), (7, 1)), odd.as_strided((2, 1, 48), (48, 5, 1)),
                _values(2 * 3 * 4 * 5, torch.float16, 12).to(device).view(2, 3, 4, 5).to(memory_format=torch.channels_last)]
    # overlapping (each element counted as often as the tensor holds it): expanded (zero strides),
    # unfolded windows; and a negative-bit view (its values, not the negated memory)
    tensors += [_values(40, torch.float16, 13).to(device).view(40, 1).expand(40, 30),
                _values(300, torch.bfloat16, 14).to(device).unfold(0, 50, 7),
                torch._neg_view(_values(600, torch.float32, 15).to(device).view(20, 30).t())]
    kept, taken = [], []
    for t in tensors:
        kept.append(t.resolve_neg().clone())  # (the values it had when staged)
        taken.append(rows.stage(t, t.numel()))
        t.fill_(math.nan) if t.is_contiguous() else t.zero_()  # a write after the hook changes no row
    assert taken == list(range(len(tensors)))
    counts, extrema = rows.finish()
    assert counts.shape == (len(tensors), len(COUNT_NAMES) + (279 if hist else 0))
    for t, c, e in zip(kept, counts.cpu(), extrema.cpu()):
        _check(t.cpu(), c, e)
    assert rows.n == 0 and rows.stats(0, 0, hist) is not None  # free for the next step


def test_staging_a_tensor_that_requires_grad_joins_no_autograd_graph(copier):
    """An activation staged in a forward hook (grad mode on, the tensor in the graph): the staging
    buffer stays out of the graph, the tensor's graph is unchanged, and grad mode is restored."""
    rows = _staged(copier, elements=1 << 12)
    w = torch.randn(8, 8, requires_grad=True)
    y = (w * 3).to(torch.bfloat16)
    fn = y.grad_fn
    rows.stage(y, y.numel())
    assert torch.is_grad_enabled() and y.grad_fn is fn and not rows.buffer.requires_grad
    counts, extrema = rows.finish()
    _check(y.detach(), counts[0], extrema[0])
    y.float().sum().backward()  # (the graph still runs)
    assert torch.equal(w.grad, torch.full_like(w, 3.0))


@pytest.mark.parametrize("requires_grad", [True, False])
def test_staging_a_dual_tensor_gives_the_buffer_no_tangent(requires_grad, copier):
    """Under forward-mode AD (a dual level entered: jvp-based training, functorch) a staged dual
    tensor's values are staged, its tangent is not: the buffer never becomes a dual tensor (it would
    then carry, and every later copy update, a 16 MiB tangent until the level exits)."""
    import torch.autograd.forward_ad as fwAD

    rows = _staged(copier, elements=1 << 12)
    primal = _values(64, torch.float32, seed=5).requires_grad_(requires_grad)
    with fwAD.dual_level():
        x = fwAD.make_dual(primal * 1, torch.ones(64))
        rows.stage(x, x.numel())
        assert fwAD.unpack_dual(rows.buffer).tangent is None
        counts, extrema = rows.finish()
    _check(primal.detach(), counts[0], extrema[0])


def test_the_kernels_staging_copy_refuses_a_wrong_buffer_or_range(fused):
    """``stage_copy`` checks where it writes: a buffer that is not 1-D contiguous float32 and
    elements outside the buffer raise, and nothing is written."""
    buf = torch.zeros(100)
    x = torch.ones(10, 10)
    for bad, match in ((lambda: fused.stage_copy(torch.zeros(100, dtype=torch.float64), x, 0), "float32"),
                       (lambda: fused.stage_copy(torch.zeros(10, 20).t(), x, 0), "contiguous"),
                       (lambda: fused.stage_copy(buf, x, 1), "outside"),
                       (lambda: fused.stage_copy(buf, x, -1), "outside")):
        with pytest.raises(RuntimeError, match=match):
            bad()
    assert not buf.any()
    fused.stage_copy(buf[50:], x[:5], 0)  # (a view: written at its own offset)
    assert buf[:50].eq(0).all() and buf[50:].eq(1).all()


def test_a_row_read_before_the_step_ends_is_taken_then():
    rows = StagedRows(torch.device("cpu"), elements=1 << 12)
    x = _values(700, torch.bfloat16, seed=1)
    first = rows.stats(rows.stage(x, 700), 1, True)
    second = rows.stage(_values(300, torch.float16, seed=2), 300)
    _check(x, first.counts[0], first.extrema[0])  # (reading it took the staged pass)
    assert rows.stats(second, 1, True).counts.shape == (1, len(COUNT_NAMES) + 279)


class ConvNet(torch.nn.Module):
    """Conv, BatchNorm, in-place ReLU (overwrites the BatchNorm's output after its hook ran), pooling."""

    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(inplace=True),
            torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(inplace=True),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.head = torch.nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.features(x))


def _record(model_fn, staged: bool, monkeypatch, dtype=torch.float16, steps=3, micro=2, evaluate=False):
    monkeypatch.setattr(StepBuffer, "stage_cpu", staged)
    monkeypatch.setattr(step_buffer, "STAGE_ELEMENTS", 5000)  # several batched passes per step
    torch.manual_seed(0)
    model, batches = model_fn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if dtype == torch.float16 else None
    with mpscope.record(model, opt, scaler) as rec:
        for i in range(steps):
            opt.zero_grad(set_to_none=True)
            if evaluate:  # an evaluation pass first (dropped from the step)
                with torch.inference_mode(), torch.autocast("cpu", dtype=dtype):
                    model(batches[i % len(batches)][0])
            for j in range(micro):
                x, y = batches[(i + j) % len(batches)]
                with torch.autocast("cpu", dtype=dtype):
                    loss = torch.nn.functional.cross_entropy(model(x).float(), y)
                (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
    assert (rec._steps.staged is not None) == staged
    run = rec.run
    assert "recording_error" not in run.meta
    return [f.reset_index(drop=True) for f in (run.tensors, run.histograms, run.steps)]


def _convnet():
    g = torch.Generator().manual_seed(1)
    return ConvNet(), [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g))
                       for _ in range(3)]


def _gpt():
    from mpscope.demo.model import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2, seq_len=16, dropout=0.0)
    g = torch.Generator().manual_seed(2)

    class LM(GPT):
        def forward(self, idx):
            return super().forward(idx).flatten(0, 1)

    data = [torch.randint(0, 64, (3, 17), generator=g) for _ in range(3)]
    return LM(cfg), [(d[:, :-1], d[:, 1:].flatten()) for d in data]


@pytest.mark.parametrize("model_fn, dtype", [(_convnet, torch.float16), (_gpt, torch.bfloat16), (_gpt, torch.float16)],
                         ids=["convnet-fp16", "gpt-bf16", "gpt-fp16"])
def test_a_recording_through_staged_rows_equals_the_host_rows(model_fn, dtype, monkeypatch):
    """The same training (micro-batches; fp16 with a GradScaler) recorded through the staged rows and
    through the host rows (the fused kernel, or the torch-op path where it is not built): the tensors,
    histograms and steps frames are equal, row order included. The ConvNet's BatchNorm outputs are
    overwritten by in-place ReLUs after their hooks: their rows keep negative minima."""
    staged = _record(model_fn, True, monkeypatch, dtype)
    host = _record(model_fn, False, monkeypatch, dtype)
    for a, b in zip(staged, host):
        assert len(a)
        pd.testing.assert_frame_equal(a, b)
    if model_fn is _convnet:
        t = staged[0]
        bn = t[(t.role == "activation") & t.module.isin(["features.1", "features.4"])]
        assert len(bn) == 6 and (bn["min"] < 0).all()


def test_the_kernels_staging_copy_taking_over_mid_run_changes_no_value(fused, monkeypatch):
    """The kernel's background build finishes during the run (``kernel.current`` returns it from
    step 1 on): step 0 stages through torch ops dispatched from Python, the later steps through
    the kernel's ``stage_copy`` (both really used), and the frames equal the host rows' (float16
    training with a GradScaler, in-place ReLUs after the hooks)."""
    import types

    calls = {"current": 0, "kernel": 0, "torch-ops": 0}

    def stage_copy(*args):
        calls["kernel"] += 1
        return fused.stage_copy(*args)

    module = types.SimpleNamespace(**{n: getattr(fused, n) for n in dir(fused) if not n.startswith("_")})
    module.stage_copy = stage_copy

    def current(start=True):  # not ready when the recorder attaches and at step 0
        calls["current"] += 1
        return module if calls["current"] > 2 else None

    copy = StagedRows.copy_values

    def torch_ops(self, *args):
        calls["torch-ops"] += 1
        return copy(self, *args)

    host = _record(_convnet, False, monkeypatch)
    monkeypatch.setattr(kernel, "current", current)
    monkeypatch.setattr(StagedRows, "copy_values", torch_ops)
    staged = _record(_convnet, True, monkeypatch)
    assert calls["kernel"] > 0 and calls["torch-ops"] > 0
    assert calls["kernel"] == 2 * calls["torch-ops"]  # (steps 1 and 2 / step 0: the same tensors)
    for a, b in zip(staged, host):
        assert len(a)
        pd.testing.assert_frame_equal(a, b)


def test_staged_rows_hold_what_plain_pytorch_hooks_saw(monkeypatch):
    """The GradientTap oracle (plain forward and tensor hooks) on the demo GPT's trunk, recorded
    through the staged rows: each step's activation and activation-gradient rows hold exactly the
    outputs gradients flowed through and those gradients."""
    monkeypatch.setattr(StepBuffer, "stage_cpu", True)
    monkeypatch.setattr(step_buffer, "STAGE_ELEMENTS", 2000)
    model, batches = _gpt()
    steps = [[batches[0], batches[1]], [batches[2]]]
    t, taps = train_with_tap(model, model.parameters(), steps,
                             lambda b: torch.nn.functional.cross_entropy(model(b[0]).float(), b[1]))
    assert len(taps[0]) > 10
    for step, got in enumerate(taps):
        assert_rows_match_tap(t, step, got)


def test_staged_rows_first_used_or_grown_under_inference_mode_take_rows_outside_it(copier):
    """The staging buffer allocated and the rows grown inside ``torch.inference_mode()`` (an
    evaluation pass) stay writable outside it: the next tensors, staged outside, get their rows."""
    rows = _staged(copier, capacity=2, elements=3000)
    tensors = [_values(n, d, seed=n) for d in DTYPES for n in (7, 1500)]
    with torch.inference_mode():
        inside = [rows.stage(t, t.numel()) for t in tensors[:4]]  # (allocates, grows the rows, a pass)
    outside = [rows.stage(t, t.numel()) for t in tensors[4:]]
    assert inside + outside == list(range(len(tensors)))
    counts, extrema = rows.finish()
    for t, c, e in zip(tensors, counts, extrema):
        _check(t, c, e)


def test_an_inference_mode_evaluation_before_the_first_training_pass_records_as_the_host_rows(monkeypatch):
    """Each step begins with an evaluation pass under ``torch.inference_mode()`` (the first one
    allocates the staging buffer): the recording goes on (no internal error) and its frames equal the
    host rows'."""
    staged = _record(_convnet, True, monkeypatch, torch.bfloat16, evaluate=True)
    host = _record(_convnet, False, monkeypatch, torch.bfloat16, evaluate=True)
    for a, b in zip(staged, host):
        assert len(a)
        pd.testing.assert_frame_equal(a, b)


PARAMETER_ROLES = ("weight", "param_grad", "optimizer_state")


def _record_until_the_pass_fails(staged: bool, elements: int, monkeypatch):
    """Five AdamW steps of the ConvNet, every third recorded; through the staged rows the batched
    pass fails from step 3 on. Returns the recorder and the trained model."""
    monkeypatch.setattr(StepBuffer, "stage_cpu", staged)
    monkeypatch.setattr(step_buffer, "STAGE_ELEMENTS", elements)
    torch.manual_seed(0)
    model, batches = _convnet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def boom(*a, **k):
        raise RuntimeError("batched pass exploded")

    with mpscope.record(model, opt, every=3) as rec:
        for i in range(5):
            if i == 3 and staged:
                monkeypatch.setattr(step_buffer._stats, "staged_stats", boom)
            x, y = batches[i % len(batches)]
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return rec, model


@pytest.mark.parametrize("elements, kept", [(1 << 20, [0, 1, 2, 3]), (3000, [0, 1, 2])],
                         ids=["at-the-step-end", "in-a-hook"])
def test_a_failed_batched_pass_keeps_the_rows_recorded_before_it(elements, kept, monkeypatch):
    """Steps 1 and 2 (not recorded) wait in the step buffer when step 3's batched pass fails, at the
    step's end (its parameter rows are taken then too) or in a forward hook when the buffer is full:
    one internal-error warning, hooks removed, training unchanged, and the finished steps' rows and
    the failed step's other observations equal a recording through the host rows."""
    host, plain = _record_until_the_pass_fails(False, elements, monkeypatch)
    with pytest.warns(RuntimeWarning, match="internal error in .*batched pass exploded") as caught:
        rec, model = _record_until_the_pass_fails(True, elements, monkeypatch)
    assert len([x for x in caught if "internal error" in str(x.message)]) == 1
    assert not rec.attached and not any(m._forward_hooks for m in model.modules())
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)
    got, want = rec.run, host.run
    pd.testing.assert_frame_equal(got.steps.reset_index(drop=True),
                                  want.steps[want.steps.step.isin(kept)].reset_index(drop=True))
    w = want.tensors
    w = w[(w.step == 0) | ((w.step == 3) & w.role.isin(PARAMETER_ROLES) & (3 in kept))]
    pd.testing.assert_frame_equal(got.tensors.reset_index(drop=True), w.reset_index(drop=True))


def test_the_staging_buffer_is_freed_when_the_recording_ends_and_made_again_on_attach(monkeypatch):
    """A recorder outlives its recording (its Run is read afterwards): its staging buffer does not.
    Attached again, the same recorder stages into a new buffer and records as the host rows do."""
    import gc
    import weakref

    def train(staged):
        monkeypatch.setattr(StepBuffer, "stage_cpu", staged)
        monkeypatch.setattr(step_buffer, "STAGE_ELEMENTS", 5000)
        torch.manual_seed(0)
        model, batches = _convnet()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rec = mpscope.record(model, opt)
        buffers = []
        for k in range(2):
            with rec:
                for x, y in batches[:2]:
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
                    if staged:
                        buffers.append(weakref.ref(rec._steps.staged.buffer))
            gc.collect()
            assert all(b() is None for b in buffers)
        return [f.reset_index(drop=True) for f in (rec.run.tensors, rec.run.histograms, rec.run.steps)]

    for a, b in zip(train(True), train(False)):
        assert len(a)
        pd.testing.assert_frame_equal(a, b)


@pytest.mark.parametrize("staged", [True, False], ids=["staged-rows", "host-rows"])
def test_a_recorder_attached_under_inference_mode_records_the_training_after_it(staged, monkeypatch):
    """A recorder made and attached inside ``torch.inference_mode()`` (an evaluation pass first),
    then training outside it: the step buffer's rows are no inference tensors, so the recording
    equals one attached outside inference mode."""
    monkeypatch.setattr(StepBuffer, "stage_cpu", staged)
    monkeypatch.setattr(step_buffer, "STAGE_ELEMENTS", 5000)

    def train(inside):
        torch.manual_seed(0)
        model, batches = _convnet()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with torch.inference_mode(inside):
            rec = mpscope.record(model, opt).__enter__()
            model(batches[0][0])
        try:
            for x, y in batches:
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        finally:
            rec.__exit__(None, None, None)
        assert "recording_error" not in rec.run.meta
        return [f.reset_index(drop=True) for f in (rec.run.tensors, rec.run.histograms, rec.run.steps)]

    for a, b in zip(train(True), train(False)):
        assert len(a)
        pd.testing.assert_frame_equal(a, b)
