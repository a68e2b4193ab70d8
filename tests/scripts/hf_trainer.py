"""transformers.Trainer on a tiny GPT-2 built from a config (random weights, no download), CPU,
bfloat16 autocast, gradient accumulation 2 (test script for `mpscope run`); writes the Trainer's
per-step logged losses to OUT/log_history.json and the final weights to OUT/weights.pt.

    python hf_trainer.py OUT
"""

import json
import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(out: Path):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir=str(out / "trainer"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=4, logging_steps=1, learning_rate=1e-3,
                             bf16=True, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    (out / "log_history.json").write_text(json.dumps(losses))
    torch.save(model.state_dict(), out / "weights.pt")


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    main(out)
