"""A Lightning fit (test script for `mpscope run`): the LightningModule's training_step calls its
network (`self.net`), never `self(...)`; bfloat16 autocast ("bf16-mixed") on the CPU; writes each
training step's loss to OUT/losses.json and the final weights to OUT/weights.pt.

    python lightning_fit.py OUT
"""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def main(out: Path):
    torch.manual_seed(0)
    x = torch.randn(40, 8)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    module = Regressor()
    trainer = pl.Trainer(max_steps=5, accelerator="cpu", devices=1, precision="bf16-mixed", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    (out / "losses.json").write_text(json.dumps(module.losses))
    torch.save(module.state_dict(), out / "weights.pt")


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    main(out)
