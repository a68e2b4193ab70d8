"""The step buffer: what the recorder's hooks leave on the device, and its one host copy per step.

Per step, the hooks write the step's scalars (:data:`STEP_SCALARS`) into that step's row of a
preallocated ``(STEP_SLOTS, len(STEP_SCALARS))`` float64 device buffer with in-place ops only, and
keep each observed tensor's device stats in an :class:`Observation`. When a recorded step ends (or the
buffer is full, or the recording ends) :class:`StepBuffer` copies the finished steps' rows and the
step's stats to the host in one transfer (non-blocking into pinned memory on CUDA, processed when
the copy has landed) and appends them to the :class:`~mpscope.run.Run` as rows.

Nothing else in the recording reads a device value on the host: every function of this module
runs at that copy (the host-sync tests exempt this file and nothing else).
"""

from __future__ import annotations

import bisect
import math
from typing import NamedTuple

import numpy as np
import torch
from torch.autograd import forward_ad as _forward_ad

from mpscope import kernel as _kernel
from mpscope import stats as _stats
from mpscope.run import StepRecord

#: The per-step scalars, one row of the recorder's device buffer per step: the step's losses
#: (summed over its backward passes), the loss scale used for its backward, 1.0 if the GradScaler
#: found inf/NaN gradients, the scale after ``update()``, the norm ``clip_grad_norm_`` returned,
#: the same norm of the same gradients computed in float32 and their largest |g| (both taken just
#: before the clip, on recorded steps), and 1.0 / 0.0 when every ``.grad`` was None or zero / not
#: before the step's first backward (NaN when not recorded).
STEP_SCALARS = ("loss", "loss_scale", "found_inf", "scale_after", "clip_norm", "clip_norm_fp32",
                "clip_grad_absmax", "grad_reset")
LOSS, SCALE, FOUND_INF, SCALE_AFTER, CLIP, CLIP32, CLIP_GMAX, RESET = range(len(STEP_SCALARS))
#: What a step's row holds until the step writes it: no loss (NaN), loss scale 1.0 and no inf
#: found (the values without a GradScaler), scale after 1.0, no clip (NaN), grad reset not
#: checked (NaN). The recorder opens each step's row with one copy of it (``StepBuffer.blank``);
#: a step writes only what it saw.
BLANK_ROW = (float("nan"), 1.0, 0.0, 1.0, float("nan"), float("nan"), float("nan"), float("nan"))
#: Rows of that buffer: non-recorded steps reach the host at the latest every STEP_SLOTS steps.
STEP_SLOTS = 256


#: A single-tensor observation whose stats are a row of the step's :class:`RowTables` or
#: :class:`StagedRows` (``tables.log``): a plain tuple of these fields, in this order. The per-tensor
#: path makes one per tensor, in Python or in the kernel's C++ (which checks this order against its
#: own when a step begins: ``hook_state``); a tuple subclass costs some 300 instructions more per
#: tensor to make and free. ``key``: the row's key (module, role, name, dtype); ``row``: its row of
#: the tables; ``scaled``: multiplied by the loss scale (a gradient before ``unscale_``);
#: ``pass_id``: the :class:`~mpscope.recording.passes.Pass` it belongs to (None: of no pass);
#: ``at``: the number of the step's :class:`Observation` s before it (the host copy keeps their order).
LOG_ENTRY = ("key", "row", "numel", "scaled", "pass_id", "at")
LOG_KEY, LOG_ROW, LOG_NUMEL, LOG_SCALED, LOG_PASS, LOG_AT = range(len(LOG_ENTRY))


class StepFlags(NamedTuple):
    """What the host knows of a finished step (its device row holds the rest of a
    :class:`~mpscope.run.StepRecord`)."""

    skipped: bool  #: the optimizer step did not run
    recorded: bool
    backward_count: int
    clipped_before_unscale: bool
    opt_scaled: bool
    autocast_at_step: bool
    skips_inside: bool  #: the optimizer takes the GradScaler's found_inf itself (fused Adam): skipped when found
    final: bool  #: the recording's end, not a step boundary


class Observation:
    """Device stats of one or more tensors waiting for the step's host copy.

    ``src``: None, or the single-tensor ``Observation`` of the same tensor taken earlier this step (a
    module that returns its child's output, ``Dropout(p=0)``, ``Identity``): its row is reused,
    nothing is computed or copied twice. ``row``: None, or the first of the ``len(keys)`` rows of the
    step buffer's :class:`RowTables` that hold the stats (the fused CPU kernel wrote them there; ``ds``
    is None then).
    """

    __slots__ = ("keys", "numels", "dtypes", "scaled", "ds", "hist", "src", "pass_id", "row")

    def __init__(self, keys, numels, dtypes, scaled, ds, hist, src=None, pass_id=None, row=None):
        self.keys, self.numels, self.dtypes, self.scaled, self.ds, self.hist = keys, numels, dtypes, scaled, ds, hist
        self.src = src
        self.pass_id = pass_id  # the forward pass of the model it came from (None: not from one)
        self.row = row


class RowTables:
    """Preallocated host rows the fused CPU kernel writes a recorded step's stats into
    (:func:`mpscope.kernel.fused_stats_into`): no allocation per observed tensor, and at the step's
    end the rows are read in place (no concatenation, no copy).

    ``counts``: int64 (capacity, 10 + NHIST), ``extrema``: float64 (capacity, 3), laid out as
    :class:`mpscope.stats.DeviceStats` describes; ``n`` rows are in use. The capacity doubles when
    a step needs more (the rows written so far are copied over) and stays for the next steps.

    ``log``: the step's single-tensor observations whose stats are rows here, in order, one
    :data:`LOG_ENTRY` tuple each; a tensor seen again in the step logs its row again. ``hist``: the
    logged rows hold an exponent histogram (one setting per step, set when the step begins).
    ``kernel``: the loaded kernel module that writes these rows (None until the recorder sets it);
    the host copy also takes the histogram's non-zero bins with it.
    """

    WIDTH = len(_stats.COUNT_NAMES) + _stats.NHIST

    def __init__(self, capacity: int = 512) -> None:
        self.n = 0
        self.log: list[tuple] = []
        self.hist = True
        self.kernel = None
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        counts = torch.zeros(capacity, self.WIDTH, dtype=torch.int64)
        extrema = torch.zeros(capacity, 3, dtype=torch.float64)
        if self.n:
            counts[: self.n] = self.counts[: self.n]
            extrema[: self.n] = self.extrema[: self.n]
        self.counts, self.extrema = counts, extrema
        self.host_counts, self.host_extrema = counts.numpy(), extrema.numpy()  # the same memory
        self.capacity = capacity  # rows

    def take(self, k: int) -> int:
        """Reserve ``k`` more rows; returns the first one's index."""
        r = self.n
        if r + k > self.capacity:
            self._allocate(max(2 * self.capacity, 2 * (r + k)))
        self.n = r + k
        return r

    def stats(self, row: int, k: int, hist: bool) -> "TableStats":
        """Rows ``row .. row + k - 1`` as :class:`~mpscope.stats.DeviceStats` (views made on first
        use, valid until the step's rows are handed to the Run)."""
        return TableStats(self, row, k, hist)

    def flush(self) -> None:
        """(The rows are written when taken: nothing waits.)"""


_grad_enabled, _set_grad_enabled = torch.is_grad_enabled, torch._C._set_grad_enabled

#: Elements of a :class:`StagedRows` staging buffer (float32: 16 MiB on the device). A larger
#: tensor's stats are taken on their own, straight into its row.
STAGE_ELEMENTS = 1 << 22


class StagedRows:
    """The rows of a recorded step's stats on an accelerator (the GPU path of :class:`RowTables`).

    A statistics pass per observed tensor would cost a compiled call (guards, several kernel
    launches) on the host for every hooked tensor. Instead :meth:`stage` copies the tensor, as
    float32 (exact for float16 and bfloat16), into the next free part of a staging buffer on its
    device: one copy kernel, the conversion the statistics need anyway, taken at once so that a
    later in-place write to the tensor (``ReLU(inplace=True)``, autograd reusing a gradient buffer)
    changes nothing. When the buffer is full, when a row is read (:meth:`stats`) and at the step's
    end (:meth:`finish`), the staged tensors' stats are taken in one batched pass
    (:func:`mpscope.stats.staged_stats`) into their rows. Nothing is read back to the host.

    Same interface as :class:`RowTables` (``n``, ``log``, ``hist``, ``kernel``, :meth:`take`,
    :meth:`stats`); ``counts`` int64 (capacity, 10 + NHIST) and ``extrema`` float64 (capacity, 3)
    live on ``device``. Takes float16, bfloat16 and float32 tensors on ``device`` (float64 takes the
    :func:`~mpscope.stats.device_stats` path). The staging buffer (:data:`STAGE_ELEMENTS` float32) is
    allocated on first use and kept until the recording ends (:meth:`StepBuffer.release`); a tensor
    larger than it gets a statistics pass of its own.
    """

    WIDTH = RowTables.WIDTH
    kernel = None  # (no fused kernel reads these rows: they land on the host as a block)
    stats = RowTables.stats  # (TableStats: a staged row's pass is taken when the row is first read)

    def __init__(self, device: torch.device, capacity: int = 512, elements: int | None = None) -> None:
        self.device = device
        self.n = 0
        self.log: list[tuple] = []
        self.hist = True
        self.elements = STAGE_ELEMENTS if elements is None else elements
        self.buffer: torch.Tensor | None = None
        self.counts = torch.zeros(capacity, self.WIDTH, dtype=torch.int64, device=device)
        self.extrema = torch.zeros(capacity, 3, dtype=torch.float64, device=device)
        self.capacity = capacity  # rows (len() of a tensor costs more than the rest of a check)
        self._first = 0  # the first staged row (the staged rows are consecutive)
        self.off = 0  # staged elements
        self.sizes: list[int] = []
        self.fp16: list[bool] = []
        #: The staging copy: the fused kernel's ``stage_copy`` (set by the recorder at each step once
        #: the kernel is loaded) or None (torch ops dispatched from Python; the same values).
        self.copier = None

    def take(self, k: int) -> int:
        """Reserve ``k`` more rows; returns the first one's index (the capacity doubles as needed)."""
        r = self.n
        if r + k > self.capacity:
            self._grow(r + k)
        self.n = r + k
        return r

    def _grow(self, rows: int) -> None:
        """Room for ``rows`` rows at least (the capacity doubles; rows in use are copied over)."""
        cap, r = max(2 * self.capacity, 2 * rows), self.n
        for name, width in (("counts", self.WIDTH), ("extrema", 3)):
            old = getattr(self, name)
            with torch.inference_mode(False):  # (see _stage_slowly)
                new = torch.zeros(cap, width, dtype=old.dtype, device=self.device)
            new[:r] = old[:r]
            setattr(self, name, new)
        self.capacity = cap

    def stage(self, tensor: torch.Tensor, n: int) -> int:
        """Take the next row for ``tensor`` (float16/bfloat16/float32, on ``device``, ``n`` > 0
        elements) and stage its values; its stats are written there by the next batched pass.
        Returns the row. (The per-tensor path of a GPU run: kept to one copy and a few appends.)"""
        off = self.off
        r = self.n
        if off + n > self.elements or r == self.capacity or self.buffer is None:
            return self.stage_slowly(tensor, n)
        self.n = r + 1
        copier = self.copier
        if copier is not None:
            copier(self.buffer, tensor, off)  # (the fused kernel's stage_copy: below autograd)
        else:
            self.copy_values(tensor, off, n)
        self.off = off + n
        self.sizes.append(n)
        self.fp16.append(tensor.dtype is torch.float16)
        return r

    def copy_values(self, tensor: torch.Tensor, off: int, n: int) -> None:
        """The staging copy through torch ops (when the fused kernel is not loaded): ``tensor``'s
        values into ``buffer[off : off + n]``, joining no autograd graph."""
        if _forward_ad._current_level >= 0:  # forward-mode AD: copying a dual tensor would give
            tensor = tensor.detach()  # the buffer a tangent (a detached tensor has none)
        graph = tensor.requires_grad and _grad_enabled()
        if graph:  # (or the copy would join the autograd graph; cheaper than a detach per tensor)
            _set_grad_enabled(False)
        try:
            if tensor.is_contiguous():
                # the buffer's next n elements viewed in the tensor's own (contiguous) strides: one
                # view and the copy, no flattening view of the tensor (about 0.5 us less per tensor)
                self.buffer.as_strided(tensor.shape, tensor.stride(), off).copy_(tensor)
            else:
                self.buffer[off : off + n] = tensor.reshape(-1)
        finally:
            if graph:
                _set_grad_enabled(True)

    def stage_slowly(self, tensor: torch.Tensor, n: int) -> int:
        """:meth:`stage` when the buffer is full or not there yet, the rows are full, or the tensor
        is larger than the buffer (its own pass, straight into its row)."""
        if n > self.elements:
            self.flush()  # (keeps the staged rows consecutive)
            r = self.take(1)
            self._first = r + 1
            self._write(r, _stats.device_stats([tensor], self.hist, None))
            return r
        if self.off + n > self.elements:
            self.flush()
        if self.buffer is None:
            # never an inference tensor, even when first used under torch.inference_mode() (an
            # evaluation pass): later steps write into it outside that mode, which PyTorch refuses
            with torch.inference_mode(False):
                self.buffer = torch.empty(self.elements, dtype=torch.float32, device=self.device)
        if self.n == self.capacity:
            self._grow(self.n + 1)
        return self.stage(tensor, n)

    def flush(self) -> None:
        """Take the staged tensors' stats (one batched pass) into their rows; the buffer is free again."""
        if not self.sizes:
            return
        ds = _stats.staged_stats(self.buffer[: self.off], tuple(self.sizes), tuple(self.fp16), self.hist)
        self._write(self._first, ds)
        self._first = self.n
        self.off = 0
        self.sizes.clear()
        self.fp16.clear()

    def _write(self, row: int, ds: _stats.DeviceStats) -> None:
        k, width = ds.counts.shape
        self.counts[row : row + k, :width] = ds.counts
        self.extrema[row : row + k] = ds.extrema

    def drop(self) -> None:
        """Forget the step's rows and what is staged (when their batched pass failed)."""
        self.n = self._first = self.off = 0
        self.sizes.clear()
        self.fp16.clear()

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rows, ready: ``(counts, extrema)`` views of rows ``0 .. n - 1`` (counts
        without the histogram columns when the step takes none). Frees the rows for the next step."""
        self.flush()
        n, width = self.n, (self.WIDTH if self.hist else len(_stats.COUNT_NAMES))
        self.n = self._first = 0
        return self.counts[:n, :width], self.extrema[:n]


class TableStats(_stats.DeviceStats):
    """:class:`~mpscope.stats.DeviceStats` of rows of :class:`RowTables`; ``counts`` and ``extrema``
    are views made when first read (most callers never read them)."""

    __slots__ = ("_tables", "_row", "_k")

    def __init__(self, tables: RowTables, row: int, k: int, hist: bool):
        self._tables, self._row, self._k, self.hist = tables, row, k, hist

    @property
    def counts(self) -> torch.Tensor:
        width = RowTables.WIDTH if self.hist else len(_stats.COUNT_NAMES)
        self._tables.flush()
        return self._tables.counts[self._row : self._row + self._k, :width]

    @property
    def extrema(self) -> torch.Tensor:
        self._tables.flush()
        return self._tables.extrema[self._row : self._row + self._k]


class StepBuffer:
    """The device rows of the steps not yet copied, and the copies on their way to the host.

    ``builder``: the :class:`~mpscope.run.RunBuilder` of the Run the rows are appended to (the
    recording's own rows, ``recorder.local_run``). ``row``: the open step's row of the device
    buffer, a float64 view of ``len(STEP_SCALARS)`` values indexed by :data:`LOSS`, :data:`SCALE`,
    ... (its values are uninitialised until written); None until :meth:`allocate`.
    """

    def __init__(self, builder) -> None:
        self.builder = builder
        self.ring: torch.Tensor | None = None  # (STEP_SLOTS, len(STEP_SCALARS)) float64, on the model's device
        self.rows: list[torch.Tensor] = []  # its rows as views, made once (a hook indexes no tensor)
        self.row: torch.Tensor | None = None
        self.blank: torch.Tensor | None = None  # BLANK_ROW on the device
        # finished steps whose scalars wait in the ring for the next host copy: (index, StepFlags)
        self.scalars: list[tuple[int, StepFlags]] = []
        self._pending_host: list = []  # CUDA copies in flight: (pinned buffer, event, _process's arguments)
        self.host_tables = RowTables()  # the fused CPU kernel's rows
        self.staged: StagedRows | None = None  # the rows on an accelerator (allocate)
        self.tables: RowTables | StagedRows = self.host_tables  # the open step's rows (use_staged)

    def allocate(self, device: torch.device) -> None:
        """The device buffer on ``device`` (at attach: no hook allocates). Never inference tensors,
        even when attached under ``torch.inference_mode()``: the steps write into them outside it."""
        with torch.inference_mode(False):
            self.ring = torch.empty(STEP_SLOTS, len(STEP_SCALARS), dtype=torch.float64, device=device)
            self.rows = list(self.ring.unbind(0))
            self.row = self.rows[len(self.scalars)]
            self.blank = torch.tensor(BLANK_ROW, dtype=torch.float64).to(device)
            if device.type != "cpu" or self.stage_cpu:
                self.staged = StagedRows(device)

    #: Stage on the CPU too (tests and benchmarks take the GPU path on the CPU with this).
    stage_cpu = False

    def release(self) -> None:
        """Free the staging buffer when the recording ends (a recorder is kept for its Run; the
        buffer is allocated again on first use if it attaches again)."""
        if self.staged is not None:
            self.staged.buffer = None

    def use_staged(self, on: bool) -> None:
        """The open step's single-tensor observations go to the staged rows (``on``, when there are
        any) or to the host rows. Called when a step begins (its log is empty then)."""
        self.tables = self.staged if on and self.staged is not None else self.host_tables

    def push(self, index: int, flags: StepFlags, obs: list[Observation], step: int) -> None:
        """Step ``index`` ended (its row is written; ``flags``: its host-side facts). Recorded steps
        go to the host at once with their observations ``obs`` (and ``tables.log``); idle steps only
        keep their row, which travels with the next recorded step's copy (or when the buffer is
        full)."""
        self.scalars.append((index, flags))
        if flags.recorded or len(self.scalars) >= STEP_SLOTS:
            self._flush(obs, step)
        self.row = self.rows[len(self.scalars)]

    def drain(self, block: bool, obs: list[Observation], step: int) -> None:
        """Process the host copies that have landed. With ``block``: first copy the finished steps
        not yet copied and ``obs``, then wait for every copy; the open step's row (what it has
        written, the rest as opened) moves to the buffer's first row."""
        if block and (self.scalars or obs or self.tables.log or self.tables.n):
            open_row = len(self.scalars)
            self._flush(obs, step)
            self.row = self.rows[0]
            if open_row:
                self.row.copy_(self.rows[open_row])  # the open step's row follows the reset
        while self._pending_host:
            host, event, args = self._pending_host[0]
            if not block and not event.query():
                return
            event.synchronize()
            self._pending_host.pop(0)
            self._process(host.numpy(), *args)

    def _flush(self, obs: list[Observation], step: int) -> None:
        """Copy the finished steps' scalars and one step's stats to the host in one transfer
        (non-blocking into pinned memory on CUDA; processed when the copy has landed)."""
        scalars, self.scalars = self.scalars, []
        tables = self.tables
        log, tables.log = tables.log, []
        hist = tables.hist
        staged = None  # the staged rows' block: (rows, counts width), after the scalars
        if tables is self.staged and (log or tables.n):
            try:
                c, e = tables.finish()
            except Exception:
                # the batched pass failed: the step's staged rows are lost, not the finished steps'
                # scalars nor the observations (rows recorded before a failure are kept)
                tables.drop()
                self.scalars = scalars
                self._flush(obs, step)
                self.drain(True, [], step)  # (on CUDA: landed before the error ends the recording)
                raise
            if log:
                staged = c.shape
                parts_staged = [c.reshape(-1), e.reshape(-1).view(torch.int64)]
        if not scalars and not obs and not log:
            return
        parts, layout = [], []
        if scalars:
            parts.append(self.ring[: len(scalars)].reshape(-1).view(torch.int64))
        if staged is not None:
            parts.extend(parts_staged)
        # the observations' device stats, stacked into one block per counts width and device
        # (usually one block): a concatenation per block, not a copy per observation. Layout:
        # (observation, where): None (an earlier observation's rows), _TABLE (host-table rows) or
        # (its block, its first row there); a block is [number, rows, counts width, observations]
        blocks: dict[tuple, list] = {}  # (width, device) -> block
        for o in obs:
            if o.src is not None:
                layout.append((o, None))
            elif o.row is not None:
                layout.append((o, _TABLE))
            else:
                c = o.ds.counts
                b = blocks.setdefault((c.shape[1], c.device), [len(blocks), 0, c.shape[1], []])
                layout.append((o, (b, b[1])))
                b[1] += c.shape[0]
                b[3].append(o)
        for (_, dev), (_, _, _, members) in blocks.items():
            c = torch.cat([o.ds.counts for o in members]) if len(members) > 1 else members[0].ds.counts
            e = torch.cat([o.ds.extrema for o in members]) if len(members) > 1 else members[0].ds.extrema
            target = parts[0].device if parts else dev
            parts.extend((c.reshape(-1).to(target), e.reshape(-1).view(torch.int64).to(target)))
        dev = parts[0].device if parts else None
        args = (scalars, layout, log, hist, step, staged)
        if not parts:  # every observation is in the host tables and no step waits
            self._process(np.zeros(0, dtype=np.int64), *args)
        else:
            packed = torch.cat(parts) if len(parts) > 1 else parts[0]
            if dev.type == "cuda":
                host, event = _stats.to_host_async(packed)
                self._pending_host.append((host, event, args))
                self.drain(False, [], step)
            else:
                self._process(packed.numpy(), *args)
        if obs or log:  # every observation of the step has been read: its table rows are free again
            self.host_tables.n = 0

    def _process(self, buf: np.ndarray, scalars, layout, log: list[tuple], log_hist: bool, current: int,
                 staged: tuple[int, int] | None = None) -> None:
        """Turn one landed copy into Run rows: a steps row per finished step, then the stats rows
        (and histogram rows) of the last one (``current``: the step of stats copied without one),
        from its observations (``layout``) and its single-tensor table rows (``log``, with a
        histogram when ``log_hist``; see :class:`RowTables`), in observation order. ``staged``:
        the log's rows are not the host tables' but the staged rows' block (its ``(rows, counts
        width)``), landed right after the scalars."""
        pos, step_scale = self._append_steps(buf, scalars)
        step = scalars[-1][0] if scalars else current
        host = (self.host_tables.host_counts, self.host_tables.host_extrema)
        logged = host  # the table of the log's rows
        if staged is not None:
            n, width = staged
            logged = (buf[pos : pos + n * width].reshape(n, width),
                      buf[pos + n * width : pos + n * (width + 3)].view(np.float64).reshape(n, 3))
            pos += n * (width + 3)
        runs = _RowRuns(logged)
        runs.read(buf, pos, layout, log, log_hist, logged, host)
        if runs.keys:
            scale = step_scale.get(step, 1.0)
            g = self._append_tensor_rows(runs, step, scale)
            if runs.hist_keys:
                self._append_hist_rows(runs, g, step, scale)

    def _append_steps(self, buf: np.ndarray, scalars: list) -> tuple[int, dict]:
        """A :class:`~mpscope.run.StepRecord` per finished step ``(index, StepFlags)`` in
        ``scalars``, from its row at the start of ``buf``; returns where the rest of ``buf`` starts
        and each step's loss scale."""
        step_scale = {}
        if not scalars:
            return 0, step_scale
        ns = len(STEP_SCALARS)
        vals = buf[: ns * len(scalars)].view(np.float64).reshape(len(scalars), ns)
        for (idx, flags), v in zip(scalars, vals):
            loss, scale, found, after, clip, clip32, gmax, reset = (float(x) for x in v)
            step_scale[idx] = scale
            self.builder.append_step(StepRecord(
                idx, loss, scale, found > 0, flags.skipped or (flags.skips_inside and found > 0), after, flags.recorded,
                flags.backward_count, clip, flags.clipped_before_unscale, flags.opt_scaled, flags.autocast_at_step,
                clip32, gmax, reset))
        return ns * len(scalars), step_scale

    def _append_tensor_rows(self, runs: "_RowRuns", step: int, scale: float) -> "_Groups":
        """The step's tensor rows from ``runs``: repeated keys (micro-batches, a module called twice)
        merge: counts and numel add, extrema combine, the loss scale is the first observation's.
        Returns the rows' key groups."""
        g = _Groups(_column(runs.keys, np.int64))
        ext = np.concatenate(runs.extrema) if len(runs.extrema) > 1 else runs.extrema[0]
        if not g.unique:
            ext = np.stack([g.reduce(np.maximum, ext[:, 0]), g.reduce(np.minimum, ext[:, 1]),
                            g.reduce(np.minimum, ext[:, 2])], axis=1)
        counts = np.concatenate(runs.counts) if len(runs.counts) > 1 else runs.counts[0]
        hr = _stats.host_rows(g.reduce(np.add, counts), ext)
        cols = {"step": np.full(len(g.keys), step, dtype=np.int64), "key": g.keys,
                "numel": g.reduce(np.add, _column(runs.numels, np.int64)),
                "min": hr["min"], "max": hr["max"], "absmin_nonzero": hr["absmin_nonzero"],
                "loss_scale": np.ones(len(g.keys)) if scale == 1.0 else
                g.first(np.where(_column(runs.scaled, bool), scale, 1.0))}
        for name in _stats.COUNT_NAMES:
            cols[f"{name}_count"] = hr[f"{name}_count"]
        self.builder.append_rows(cols)
        return g

    def _append_hist_rows(self, runs: "_RowRuns", g: "_Groups", step: int, scale: float) -> None:
        """The step's histogram rows from ``runs`` (``g``: the tensor rows' key groups)."""
        if len(runs.hist_keys) != len(runs.keys):  # (equal lengths: every row holds a histogram, the same keys)
            g = _Groups(_column(runs.hist_keys, np.int64))
        r, e, count = _hist_nonzero(runs.hists, g, self.host_tables.kernel)
        e += _stats.EXP_MIN
        # a gradient's bins are in scaled units: its key's first observation says whether it was
        # multiplied by the loss scale (a power of two: log2 is an integer)
        shift = round(math.log2(scale)) if 0 < scale < math.inf else 0
        if shift and (hs := _column(runs.hist_scaled, bool)).any():
            e -= np.where(g.first(hs), shift, 0)[r]
        self.builder.append_hist({"step": np.full(len(r), step, dtype=np.int64), "key": g.keys[r], "exponent": e,
                                  "count": count})


_TABLE = "table"  # layout mark: the observation's stats are rows of the host tables


class _RowRuns:
    """A step's stats in observation order, as runs of rows of one table: the host tables
    (single-tensor rows in the log, observations with ``row``) or a landed block of device stats.
    Keys, numels, scaled flags and rows are gathered as chunks (a log span's tuple, an observation's
    list or array, a range of rows), made arrays once at the end (:func:`_column`): converting Python
    ints one by one is the largest NumPy cost of a step's host copy. A chunk goes to the ``hist_``
    lists too when its rows hold a histogram, so equal chunk counts mean the same rows."""

    def __init__(self, table) -> None:
        self.counts, self.extrema, self.hists = [], [], []
        self.keys, self.numels, self.scaled = [], [], []
        self.hist_keys, self.hist_scaled = [], []
        self._rows, self._hist_rows = [], []  # rows of the current table not yet taken (all; with a histogram)
        self._table = table  # the table the pending rows belong to

    def add(self, table, rows, keys, numels, scaled, hist: bool) -> None:
        """Rows ``rows`` (a range, or a tuple of row numbers) of ``table`` hold the stats of ``keys``."""
        if table is not self._table:
            self.take()
            self._table = table
        self._rows.append(rows)
        self.keys.append(keys)
        self.numels.append(numels)
        self.scaled.append(scaled)
        if hist:
            self._hist_rows.append(rows)
            self.hist_keys.append(keys)
            self.hist_scaled.append(scaled)

    def take(self) -> None:
        """Read the pending rows of the current table (its counts and extrema by one index)."""
        tc, te = self._table
        nc = len(_stats.COUNT_NAMES)
        at = None
        if self._rows:
            at = _row_index(_column(self._rows, np.int64))
            self.counts.append(tc[at, :nc])
            self.extrema.append(te[at])
        if self._hist_rows:  # (the same rows when every one holds a histogram, the usual step)
            same = len(self._hist_rows) == len(self._rows)
            self.hists.append((tc, at if same else _row_index(_column(self._hist_rows, np.int64))))
            self._hist_rows.clear()
        self._rows.clear()

    def read(self, buf: np.ndarray, pos: int, layout, log: list[tuple], log_hist: bool, logged, host) -> None:
        """Add every observation of ``layout`` and log entry of ``log`` (the log's rows are of table
        ``logged``, observations' rows of the host tables ``host`` or of blocks landed in ``buf``
        from ``pos``), in observation order, then take the last rows."""
        landed: list[tuple[np.ndarray, np.ndarray]] = []  # the blocks, (counts, extrema)
        where: dict[int, tuple] = {}  # id(observation) -> (its table, its first row there)
        if log:
            lkeys, lrows, lnumels, lscaled, _, lat = zip(*log)
        taken = 0  # log entries taken
        for n_obs, (o, w) in enumerate(layout + [(None, None)]):
            if log:  # the log entries before the n_obs-th observation (all, after the last)
                end = len(log) if o is None else bisect.bisect_right(lat, n_obs, lo=taken)
                if end > taken:
                    span = slice(taken, end)
                    self.add(logged, lrows[span], lkeys[span], lnumels[span], lscaled[span], log_hist)
                    taken = end
            if o is None:
                break
            if w is _TABLE:
                table, first = host, o.row
            elif w is None:
                table, first = where[id(o.src)]
            else:
                (block, n, width, _), first = w
                if block == len(landed):  # the blocks land in order, each after the one before
                    c = buf[pos : pos + n * width].reshape(n, width)
                    pos += n * width
                    landed.append((c, buf[pos : pos + 3 * n].view(np.float64).reshape(n, 3)))
                    pos += 3 * n
                table = landed[block]
            where[id(o)] = (table, first)
            self.add(table, range(first, first + len(o.keys)), o.keys, o.numels, o.scaled, o.hist)
        self.take()


def _hist_nonzero(pieces: list[tuple[np.ndarray, slice | np.ndarray]], g: "_Groups", kernel) -> tuple[np.ndarray, ...]:
    """The non-zero exponent histogram bins of a step's histogram rows, their keys' rows merged.

    ``pieces``: ``(counts, index)`` in row order, ``counts`` being host counts as
    :class:`~mpscope.stats.DeviceStats` lays them out (10 counts, then the bins) and ``index`` the
    rows taken from it; ``g``: the rows' key groups. Returns ``(entry, bin, count)``: per non-zero
    bin the group it belongs to (an index of ``g.keys``), the bin (exponent - ``EXP_MIN``) and its
    count, by group then bin. ``kernel``: the loaded fused kernel module, which reads each piece's
    rows in place (:func:`mpscope.kernel.hist_nonzero`; several pieces whose keys repeat are
    concatenated first, as their rows add up); without it, NumPy.
    """
    nc = len(_stats.COUNT_NAMES)
    if kernel is not None and (len(pieces) == 1 or g.unique):
        # each piece read in place, no copy of its rows (on a GPU run: the landed staged block and
        # the parameter batch's block, about 1 MB a step with histograms). With unique keys a row
        # is its own entry, so a piece's entries are its rows' places after the pieces before it
        out, first = [], 0
        for table, index in pieces:
            rows = np.arange(index.start, index.stop) if isinstance(index, slice) else index
            entry, bins, count = _kernel.hist_nonzero(kernel, table, nc, _stats.NHIST, rows,
                                                      None if g.unique else g.inverse, len(g.keys))
            if first:
                entry += first
            out.append((entry, bins, count))
            first += len(rows)
        return out[0] if len(out) == 1 else tuple(np.concatenate(a) for a in zip(*out))
    if len(pieces) == 1:
        table, index = pieces[0]
    else:
        table, index = np.concatenate([t[i] for t, i in pieces]), None
    h = g.reduce(np.add, _stats.histogram_rows(table if index is None else table[index]))
    nz = h != 0
    entry, bins = np.divmod(np.flatnonzero(nz), h.shape[1])  # (2-D np.nonzero is several times slower)
    return entry, bins, h[nz]


def _row_index(rows: np.ndarray) -> slice | np.ndarray:
    """Index of host-table rows ``rows`` (int64, not empty): a slice (the rows as views, no copy)
    when they are consecutive rows in increasing order, else ``rows``. (Distinct rows spanning a
    range are not enough: when a dropped evaluation pass's rows are reused later in the step, the
    kept rows can be a permutation of a range, e.g. ``[0, 2, 1, 3]``.)"""
    first, n = int(rows[0]), len(rows)
    if rows[-1] - first == n - 1 and (n == 1 or bool((rows[1:] - rows[:-1] == 1).all())):
        return slice(first, first + n)
    return rows


def _column(chunks: list, dtype) -> np.ndarray:
    """The chunks (tuples or lists of Python numbers, ``range`` s, arrays), in order, as one array
    of ``dtype``. A range is made with ``arange`` and an array passes as it is: only a step's
    single-tensor log spans are converted number by number."""
    parts = [np.arange(c.start, c.stop, dtype=dtype) if c.__class__ is range else np.asarray(c, dtype=dtype)
             for c in chunks]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


class _Groups:
    """Rows grouped by key, groups in the order of each key's first occurrence.

    ``keys``: the distinct keys (int64); ``reduce(ufunc, x)`` reduces the rows of ``x`` over each
    group; ``first(x)``: each group's first row. When every key occurs once (the usual step) both
    return ``x`` itself. ``inverse``: each row's group (an index of ``keys``), when keys repeat.
    """

    def __init__(self, keys: np.ndarray):
        k = np.asarray(keys, dtype=np.int64)
        s = np.sort(k)
        self.unique = not bool((s[1:] == s[:-1]).any())
        if self.unique:
            self.keys = k
            return
        self.perm = np.argsort(k, kind="stable")
        ks = k[self.perm]
        self.starts = np.flatnonzero(np.r_[True, ks[1:] != ks[:-1]])
        self.order = np.argsort(self.perm[self.starts], kind="stable")
        self.keys = ks[self.starts][self.order]

    @property
    def inverse(self) -> np.ndarray:
        rank = np.empty(len(self.order), dtype=np.int64)  # sorted group -> its place in keys
        rank[self.order] = np.arange(len(self.order))
        sizes = np.diff(np.r_[self.starts, len(self.perm)])
        inv = np.empty(len(self.perm), dtype=np.int64)
        inv[self.perm] = np.repeat(rank, sizes)
        return inv

    def reduce(self, ufunc, x: np.ndarray) -> np.ndarray:
        return x if self.unique else ufunc.reduceat(x[self.perm], self.starts)[self.order]

    def first(self, x: np.ndarray) -> np.ndarray:
        return x if self.unique else x[self.perm][self.starts][self.order]
