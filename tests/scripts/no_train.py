"""Runs a model in eval mode and trains nothing (test script for `mpscope run`); exits with argv[1]."""

import sys

import torch

model = torch.nn.Linear(4, 2)
with torch.no_grad():
    print("output", model(torch.ones(1, 4)).sum().item())
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
