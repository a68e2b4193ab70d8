"""Driven by tests/test_magic.py in a separate process (IPython changes global state)."""

import json
import sys

from IPython.core.error import UsageError
from IPython.testing.globalipapp import start_ipython

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
json.dump(out, sys.stdout)
