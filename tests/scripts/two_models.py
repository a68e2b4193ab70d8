"""Two unrelated models (test script for `mpscope run`).

    python two_models.py shared    # one optimizer steps both models' parameters
    python two_models.py separate  # one optimizer per model (a GAN-like loop: the critic steps first)
"""

import sys

import torch
from torch import nn


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6))

    def forward(self, z):
        return self.net(z)


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)


torch.manual_seed(0)
generator, critic = Generator(), Critic()
mode = sys.argv[1]
if mode == "shared":
    opts = [torch.optim.SGD([*generator.parameters(), *critic.parameters()], lr=0.01)]
else:
    opts = [torch.optim.SGD(critic.parameters(), lr=0.01), torch.optim.SGD(generator.parameters(), lr=0.01)]
for step in range(4):
    z = torch.randn(8, 4)
    fake = generator(z)
    if mode == "shared":
        loss = critic(fake).pow(2).mean()
        opts[0].zero_grad()
        loss.backward()
        opts[0].step()
        continue
    critic_loss = critic(fake.detach()).pow(2).mean()
    opts[0].zero_grad()
    critic_loss.backward()
    opts[0].step()
    gen_loss = -critic(fake).mean()
    opts[1].zero_grad()
    gen_loss.backward()
    opts[1].step()
print("done")
