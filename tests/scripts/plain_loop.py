"""A plain PyTorch training loop (test script for `mpscope run`): a small MLP under CPU float16
autocast with a GradScaler and AdamW; writes each step's loss and the final weights to OUT.

    python plain_loop.py OUT [--steps N] [--raise-at K] [--interrupt-at K] [--exit-code N]

(``--raise-at K`` / ``--interrupt-at K``: RuntimeError / KeyboardInterrupt before step K, after
writing the losses so far.)
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--raise-at", type=int, default=None)
    p.add_argument("--interrupt-at", type=int, default=None)
    p.add_argument("--exit-code", type=int, default=None)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(args.steps):
        if step in (args.raise_at, args.interrupt_at):
            (out / "losses.json").write_text(json.dumps(losses))
            raise RuntimeError(f"boom at step {step}") if step == args.raise_at else KeyboardInterrupt
        x = torch.randn(8, 16, generator=gen)
        y = torch.randint(0, 4, (8,), generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
        print(f"step {step} loss {loss.item()!r}")
    (out / "losses.json").write_text(json.dumps(losses))
    torch.save(model.state_dict(), out / "weights.pt")
    if args.exit_code is not None:
        sys.exit(args.exit_code)


if __name__ == "__main__":
    main()
