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
import torch  # noqa: E402

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
