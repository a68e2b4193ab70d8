"""The state a recording's hooks read on every call, in one object shared with the kernel's C++ path.

The per-tensor hooks (a module's forward hook, an activation's gradient hook) run hundreds of times
per step. Their usual case runs in C++ once the fused kernel is loaded (``forward_hook`` and
``observe_now`` in ``mpscope/_kernel.cpp``), which reads and writes exactly the fields of
:class:`HookState`: its ``__slots__`` are the whole interface between the recorder and that path.
The kernel finds each slot once per recorded step (``hook_state``, by the names in
:data:`HookState.__slots__`, checked against its own list: ``kernel.hook_fields()``) and reads it
by offset after that. The parts of the recording that own a field write it here; nothing else of
theirs is visible to the C++ path.
"""

from __future__ import annotations


class HookState:
    """What the hooks read and write, by owner.

    Recorder: ``attached`` (bool), ``recording`` (bool: this step's stats are taken; the shadow
    clears it while mpscope's own passes run), ``meta`` (``run.meta``).
    :class:`~mpscope.recording.passes.PassLedger`: ``pass_id`` (the model's forward pass running
    now, a :class:`~mpscope.recording.passes.Pass` or None), ``hookless`` (set of grad-enabled passes
    none of whose outputs got a gradient hook yet).
    :class:`~mpscope.recording.clock.StepClock`: ``grad_tick`` (int: parameter gradients
    accumulated so far).
    :class:`~mpscope.recording.observer.Observer`: ``key_index`` (dict ``(module, role, name,
    dtype)`` -> key), ``seen`` (dict: this step's observed tensors, identity ->
    :data:`~mpscope.recording.observer.SEEN` records), ``obs`` (list of this step's
    :class:`~mpscope.recording.step_buffer.Observation`), ``rows`` (the host
    :class:`~mpscope.recording.step_buffer.RowTables` the fused kernel writes this step's rows into,
    or None), ``staged`` (the :class:`~mpscope.recording.step_buffer.StagedRows` on an accelerator, or
    None), ``hist_now`` (bool: this step takes exponent histograms), ``observe_now`` (the Python form
    of a single tensor's observation, for the cases the C++ path leaves).
    :class:`~mpscope.recording.activations.ActivationHooks`: ``names`` (``id(module)`` -> qualified
    name), ``grad_hooks`` (:class:`~mpscope.recording.grad_hooks.GradHooks`), ``gradient`` (the
    gradient hook body, ``gradient(module, name, pass, grad)``), ``autocast_seen`` (bool: the
    autocast dtype is noted in ``meta``), ``note_autocast`` (notes it).
    """

    __slots__ = ("attached", "recording", "meta", "pass_id", "hookless", "grad_tick", "key_index", "seen", "obs",
                 "rows", "staged", "hist_now", "observe_now", "names", "grad_hooks", "gradient", "autocast_seen",
                 "note_autocast")

    def __init__(self, meta: dict, key_index: dict) -> None:
        self.attached = False
        self.recording = False
        self.meta = meta
        self.pass_id = None
        self.hookless: set = set()
        self.grad_tick = 0
        self.key_index = key_index
        self.seen: dict = {}
        self.obs: list = []
        self.rows = None
        self.staged = None
        self.hist_now = False
        self.observe_now = None
        self.names: dict[int, str] = {}
        self.grad_hooks = None
        self.gradient = None
        self.autocast_seen = False
        self.note_autocast = None
