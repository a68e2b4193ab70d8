"""Driven by tests/test_magic.py in a separate process (IPython changes global state)."""

import json
import os
import sys
import tempfile

from IPython.core.error import UsageError
from IPython.testing.globalipapp import start_ipython
from IPython.utils.capture import capture_output

ip = start_ipython()
out = {}
ip.run_line_magic("load_ext", "mpscope")
out["ipython_loaded_by_import"] = None

SETUP = """
import torch, torch.nn.functional as F
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
x, y = torch.randn(64, 16), torch.randn(64, 1)
"""
LOOP = """
opt = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
for _ in range(4):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""
ip.run_cell(SETUP)
# optimizer and scaler created inside the cell: adopted automatically
ip.run_cell_magic("mpscope", "model -q -o run1", LOOP)
run = ip.user_ns["run1"]
out["cell_steps"] = len(run.steps)
out["cell_roles"] = sorted(set(run.tensors.role))
out["cell_scale"] = list(run.steps.loss_scale)
out["hooks_left"] = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in ip.user_ns["model"].modules())


def usage(line, cell=None):
    try:
        if cell is None:
            ip.run_line_magic("mpscope", line)
        else:
            ip.run_cell_magic("mpscope", line, cell)
    except UsageError as e:
        return str(e)
    return None


out["bad_model"] = usage("modle -q", LOOP)
out["not_module"] = usage("x -q", LOOP)
out["bad_every"] = usage("model --every 0 -q", LOOP)
out["bad_option"] = usage("model --evry 2", LOOP)
out["bad_sub"] = usage("frobnicate")

# a cell that raises keeps what was recorded and leaves nothing attached
ip.run_cell_magic("mpscope", "model -q -o run2", LOOP + "\nraise ValueError('boom')\n")
out["raised_steps"] = len(ip.user_ns["run2"].steps)
out["hooks_left_after_raise"] = sum(len(m._forward_hooks) for m in ip.user_ns["model"].modules())

# attach / status / detach line forms, with the optimizer found in the namespace
ip.run_line_magic("mpscope", "attach model -o run3")
ip.run_cell(LOOP.replace("opt = torch.optim.SGD(model.parameters(), lr=0.05)\n", ""))
ip.run_line_magic("mpscope", "status")
ip.run_line_magic("mpscope", "detach")
out["attach_steps"] = len(ip.user_ns["run3"].steps)
out["hooks_left_after_detach"] = sum(len(m._forward_hooks) for m in ip.user_ns["model"].modules())
# every step skipped (scale far too high): the optimizer never steps, yet it is adopted through
# scaler.step(opt) and every step is reported as skipped
ip.run_cell_magic("mpscope", "model -q -o run4", LOOP.replace("init_scale=2.0**10", "init_scale=2.0**60"))
out["all_skipped"] = [bool(v) for v in ip.user_ns["run4"].steps.skipped]
out["all_found_inf"] = [bool(v) for v in ip.user_ns["run4"].steps.found_inf]

# what a person sees (stdout + stderr) for help and for every user error
import os  # noqa: E402

from IPython.utils.capture import capture_output  # noqa: E402


def shown(src):
    with capture_output() as c:
        ip.run_cell(src)
    return c.stdout + c.stderr


out["status_last"] = shown("%mpscope status")
out["help_h"] = shown("%mpscope -h")
out["help_word"] = shown("%mpscope help")
out["help_attach"] = shown("%mpscope attach -h")
out["help_cell"] = shown("%%mpscope -h\n" + LOOP)
out["err_sub"] = shown("%mpscope stauts")
out["err_modules"] = shown("%%mpscope model -q --modules nomatch\n" + LOOP)
out["err_regex"] = shown("%%mpscope model -q --modules '('\n" + LOOP)
out["err_export_line"] = shown("%mpscope export cfg.toml run1")
out["err_export_cell"] = shown("%%mpscope model -q -o run5 --export cfg.toml\n" + LOOP)
out["err_option"] = shown("%%mpscope model --evry 2\n" + LOOP)
out["err_run"] = shown("%mpscope advise x")
out["toml_written"] = os.path.exists("cfg.toml")
out["run5_made"] = "run5" in ip.user_ns
# --apply: a cell that clips before unscale_ (an error), re-run with its recommendation applied
CLIP_LOOP = LOOP.replace("    scaler.step(opt)", "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
                         "    scaler.unscale_(opt)\n    scaler.step(opt)")
ip.run_cell_magic("mpscope", "model -q -o run6", CLIP_LOOP)
ip.run_cell_magic("mpscope", "model -q -o run6 --apply", CLIP_LOOP)
table = ip.user_ns["run6_round_trip"]
out["apply_before_clip_scaled"] = bool(ip.user_ns["run6_before"].steps.clipped_before_unscale.any())
out["apply_after_clip_scaled"] = bool(ip.user_ns["run6"].steps.clipped_before_unscale.any())
out["apply_cleared"] = table.loc["errors cleared", "after"]
out["apply_steps"] = [int(table.loc["steps", "before"]), int(table.loc["steps", "after"])]

# what mpscope may patch, as it was before any cell: compared after each exit path below
import copy  # noqa: E402

import torch  # noqa: E402

import mpscope  # noqa: E402

PATCHABLE = {
    "Tensor.backward": lambda: torch.Tensor.backward, "autograd.backward": lambda: torch.autograd.backward,
    "GradScaler.__init__": lambda: torch.amp.GradScaler.__init__, "GradScaler.scale": lambda: torch.amp.GradScaler.scale,
    "GradScaler.update": lambda: torch.amp.GradScaler.update, "GradScaler.step": lambda: torch.amp.GradScaler.step,
    "autocast.__init__": lambda: torch.autocast.__init__, "clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_,
}
ORIGINAL = {k: get() for k, get in PATCHABLE.items()}


def patched():
    return sorted(k for k, get in PATCHABLE.items() if get() is not ORIGINAL[k])


def hooks(name="model"):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in ip.user_ns[name].modules())


# a cell interrupted at step 2 keeps those steps and leaves nothing attached
ip.run_cell_magic("mpscope", "model -q -o run7", LOOP.replace("for _ in range(4):\n", "for i in range(4):\n    if i == 2:\n        raise KeyboardInterrupt\n"))
out["interrupted_steps"] = len(ip.user_ns["run7"].steps)
out["interrupted_left"] = [hooks(), patched()]
# two models in one cell, each with its own GradScaler: each run holds its own model's loss scale
ip.run_cell("model_b = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))")
TWO = """
opt_b, scaler_b = torch.optim.SGD(model_b.parameters(), lr=0.05), torch.amp.GradScaler("cpu", init_scale=2.0**5)
opt, scaler = torch.optim.SGD(model.parameters(), lr=0.05), torch.amp.GradScaler("cpu", init_scale=2.0**10)
for _ in range(3):
    for m, o, s in ((model_b, opt_b, scaler_b), (model, opt, scaler)):
        o.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(m(x).float(), y)
        s.scale(loss).backward()
        s.step(o)
        s.update()
"""
ip.run_cell_magic("mpscope", "model -q -o run_a", TWO)
ip.run_cell_magic("mpscope", "model_b -q -o run_b", TWO)
out["two_models_scales"] = [sorted(set(ip.user_ns[v].steps.loss_scale)) for v in ("run_a", "run_b")]
out["two_models_steps"] = [len(ip.user_ns[v].steps) for v in ("run_a", "run_b")]
# --apply after another model's run: one UsageError, nothing patched, nothing run
ip.run_cell("ran = 0")
out["apply_other_model"] = usage("model -q -o run_b --apply", "ran = 1\n" + LOOP)
out["apply_other_model_left"] = [ip.user_ns["ran"], hooks(), patched()]
# a cell that raises under --apply: the apply is undone and the previous run stays in its variable
ip.run_cell_magic("mpscope", "model -q -o run8", CLIP_LOOP)
previous = ip.user_ns["run8"]
ip.run_cell_magic("mpscope", "model -q -o run8 --apply", CLIP_LOOP + "\nraise ValueError('boom')\n")
out["apply_raised"] = [ip.user_ns["run8"] is previous, len(ip.user_ns["run8_applied"].steps), "run8_before" in ip.user_ns,
                       hooks(), patched()]
# --apply starts from where the last run started. The oracle: copies the test takes before the first
# cell. A bfloat16 loop without a GradScaler gets the recommendation "bfloat16, no scaler, nothing in
# float32": a no-op, so the re-run must repeat the first run bit for bit. The cell draws from torch's
# RNG (DataLoader shuffle, dropout), Python's random and NumPy's, and steps an optimizer and an LR
# scheduler made before it.
ip.run_cell("""
import copy, random, numpy as np
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(1); random.seed(1); np.random.seed(1)
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
net_opt = torch.optim.Adam(net.parameters(), lr=1e-2)
net_sched = torch.optim.lr_scheduler.StepLR(net_opt, step_size=2, gamma=0.5)
data = TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
F.mse_loss(net(data.tensors[0]), data.tensors[1]).backward(); net_opt.step()   # Adam state before the cell
net_start = copy.deepcopy((net.state_dict(), net_opt.state_dict(), net_sched.state_dict()))
""")
BF16 = """
seen = copy.deepcopy((net.state_dict(), net_opt.state_dict(), net_sched.state_dict()))   # where this run starts
for xb, yb in DataLoader(data, batch_size=16, shuffle=True):
    xb = xb + torch.from_numpy(np.random.randn(*xb.shape).astype("float32")) * random.random()
    net_opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(net(xb).float(), yb)
    loss.backward()
    net_opt.step()
    net_sched.step()
"""


def same(a, b):
    """Bitwise equality of nested state dicts (tensors compared with torch.equal)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def losses(var):
    return [float(v) for v in ip.user_ns[var].steps.loss]


ip.run_cell_magic("mpscope", "net -q -o run_n", BF16)
first = {"seen": ip.user_ns["seen"], "losses": losses("run_n"),
         "end": copy.deepcopy((ip.user_ns["net"].state_dict(), ip.user_ns["net_opt"].state_dict()))}
advice = mpscope.advise(ip.user_ns["run_n"])
with capture_output() as c:
    ip.run_cell_magic("mpscope", "net -o run_n --apply", BF16)
again_end = (ip.user_ns["net"].state_dict(), ip.user_ns["net_opt"].state_dict())
out["noop"] = {
    "advice": [advice.dtype, advice.param_dtype, advice.grad_scaler, advice.fp32_modules],
    "first_started_at_oracle": same(first["seen"], ip.user_ns["net_start"]),
    "again_started_at_oracle": same(ip.user_ns["seen"], ip.user_ns["net_start"]),
    "losses": [first["losses"], losses("run_n")],
    "first_loss_table": [float(ip.user_ns["run_n_round_trip"].loc["first loss", k]) for k in ("before", "after")],
    "same_end": same(first["end"], again_end),
    "said": c.stdout,
    "left": [hooks("net"), patched()],
}
# A float16 loop with an SGD (momentum) and a GradScaler made before the cell, init_scale far too
# high: the recommendation lowers init_scale. The re-run restores the scaler's state, then apply's
# settings win; afterwards the model, optimizer and scaler are where the same loop under
# mpscope.apply, replayed here from the test's copies, leaves them, and the scaler has its own
# settings back.
ip.run_cell("""
torch.manual_seed(2)
amp_net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
amp_opt = torch.optim.SGD(amp_net.parameters(), lr=0.05, momentum=0.9)
amp_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
amp_start = copy.deepcopy((amp_net.state_dict(), amp_opt.state_dict(), amp_scaler.state_dict(), torch.get_rng_state()))
""")
AMP = """
for _ in range(8):
    xb, yb = torch.randn(16, 16), torch.randn(16, 1)
    amp_opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(amp_net(xb).float(), yb)
    amp_scaler.scale(loss).backward()
    amp_scaler.step(amp_opt)
    amp_scaler.update()
"""
ip.run_cell_magic("mpscope", "amp_net -q -o run_amp", AMP)
amp_advice = mpscope.advise(ip.user_ns["run_amp"])
amp_before = ip.user_ns["run_amp"].steps
ip.run_cell_magic("mpscope", "amp_net -q -o run_amp --apply", AMP)
amp_after = ip.user_ns["run_amp"].steps
ns = ip.user_ns
replay = {"torch": torch, "F": torch.nn.functional, "amp_net": copy.deepcopy(ns["amp_net"])}
replay["amp_net"].load_state_dict(ns["amp_start"][0])
replay["amp_opt"] = torch.optim.SGD(replay["amp_net"].parameters(), lr=0.05, momentum=0.9)
replay["amp_opt"].load_state_dict(ns["amp_start"][1])
replay["amp_scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
torch.set_rng_state(ns["amp_start"][3])
with mpscope.apply(replay["amp_net"], amp_advice, scalers=[replay["amp_scaler"]]):
    exec(AMP, replay)
out["amp"] = {
    "advice_init_scale": amp_advice.grad_scaler["init_scale"],
    "scales": [float(amp_before.loss_scale[0]), float(amp_after.loss_scale[0])],
    "first_losses": [float(amp_before.loss[0]), float(amp_after.loss[0])],
    "skipped": [int(amp_before.skipped.sum()), int(amp_after.skipped.sum())],
    "model_as_replayed": same(ns["amp_net"].state_dict(), replay["amp_net"].state_dict()),
    "optimizer_as_replayed": same(ns["amp_opt"].state_dict(), replay["amp_opt"].state_dict()),
    "scaler": [ns["amp_scaler"].state_dict(), replay["amp_scaler"].state_dict()],
    "left": [hooks("amp_net"), patched()],
}

# A cell that takes its batches from an iterator made outside it, and steps an optimizer that lives
# in a dict: neither can be put back, and --apply says so once, naming each and how to re-create it.
ip.run_cell("""
def batches():
    g = torch.Generator().manual_seed(5)
    while True:
        yield torch.randn(16, 16, generator=g), torch.randn(16, 1, generator=g)
stream = batches()
torch.manual_seed(3)
it_net = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
holder = {"opt": torch.optim.SGD(it_net.parameters(), lr=0.1)}
it_start = copy.deepcopy(it_net.state_dict())
""")
STREAM = """
seen = copy.deepcopy(it_net.state_dict())
for _ in range(3):
    xb, yb = next(stream)
    holder["opt"].zero_grad()
    F.mse_loss(it_net(xb), yb).backward()
    holder["opt"].step()
"""
ip.run_cell_magic("mpscope", "it_net -q -o run_it", STREAM)
with capture_output() as c:
    ip.run_cell_magic("mpscope", "it_net -q -o run_it --apply", STREAM)
table = ip.user_ns["run_it_round_trip"]
out["iterator"] = {"said": c.stdout, "started_at_oracle": same(ip.user_ns["seen"], ip.user_ns["it_start"]),
                   "first_losses": [float(table.loc["first loss", k]) for k in ("before", "after")]}

# Over the size limit nothing is kept, and --apply says so
import mpscope.start_state  # noqa: E402

limit, mpscope.start_state.LIMIT_BYTES = mpscope.start_state.LIMIT_BYTES, 1024
ip.run_cell_magic("mpscope", "net -q -o run_big", BF16)
mpscope.start_state.LIMIT_BYTES = limit
trained = copy.deepcopy(ip.user_ns["net"].state_dict())
with capture_output() as c:
    ip.run_cell_magic("mpscope", "net -q -o run_big --apply", BF16)
out["over_limit"] = {"said": c.stdout, "started_where_left": same(ip.user_ns["seen"][0], trained)}
# attach / detach keeps no start: --apply after it says so
ip.run_line_magic("mpscope", "attach net -o run_att")
ip.run_cell(BF16)
ip.run_line_magic("mpscope", "detach")
with capture_output() as c:
    ip.run_cell_magic("mpscope", "net -q -o run_att --apply", BF16)
out["after_attach"] = c.stdout
# -o must be a name %mpscope advise can read back
out["bad_var"] = [usage(f"model -q -o {v}", LOOP) for v in ("1run", "import", "a.b")]
# --tensorboard: with the cell, with attach/detach, and (last: it hides the package) without tensorboard
tb = tempfile.mkdtemp(prefix="mpscope-magic-tb-")
out["tb_dir"] = tb
with capture_output() as c:
    ip.run_cell_magic("mpscope", "model -q -o run_tb1 --tensorboard " + os.path.join(tb, "cell"), LOOP)
out["tb_cell_out"] = c.stdout + c.stderr
out["tb_cell_losses"] = [float(v) for v in ip.user_ns["run_tb1"].steps.loss]
ip.run_line_magic("mpscope", "attach model -o run_tb2 --tensorboard " + os.path.join(tb, "attached"))
ip.run_cell(LOOP)
with capture_output() as c:
    ip.run_line_magic("mpscope", "detach")
out["tb_detach_out"] = c.stdout
out["tb_attached_losses"] = [float(v) for v in ip.user_ns["run_tb2"].steps.loss]
sys.modules["tensorboard"] = sys.modules["torch.utils.tensorboard"] = None  # as if not installed
out["tb_missing"] = usage("model -q -o run_tb3 --tensorboard " + os.path.join(tb, "missing"), LOOP)
out["tb_run3_made"] = "run_tb3" in ip.user_ns
json.dump(out, sys.stdout)
