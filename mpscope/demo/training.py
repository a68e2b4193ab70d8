"""``mpscope demo``: train the embedded GPT on Python's own source under autocast, recorded.

:func:`run_demo` is the whole main job on the embedded default: a character-level GPT
(:mod:`mpscope.demo.model`) learns to write standard-library Python (:mod:`mpscope.demo.data`)
under ``torch.autocast`` with a ``torch.amp.GradScaler`` (float16) and AdamW, inside
``mpscope.record``; then the Run is saved, summarised, and turned into a recommendation that is
written out as a PyTorch snippet and as JSON.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mpscope.advisor import advise
from mpscope.demo.data import STDLIB_FILES, CharDataset, stdlib_dir
from mpscope.demo.model import GPT, GPTConfig
from mpscope.recorder import record
from mpscope.summary import text_summary

__all__ = ["DEFAULT_CONFIG", "DEFAULT_STEPS", "DTYPES", "run_demo"]

#: Training steps of the default demo, and sequences per batch. Float16 matmuls have no native
#: kernel on most CPUs (about 5 GFLOP/s on the 2-core AMD EPYC of CI, 30x slower than bfloat16),
#: so the default model and batch are small (an unrecorded step at batch 16 took 0.26 s there on
#: an idle machine; batch 8 halves the work). Wall times measured: see docs/performance.md.
DEFAULT_STEPS = 200
DEFAULT_BATCH = 8
#: Default model size (vocab_size is filled in from the corpus); the benchmark uses the same class
#: at d_model=256.
DEFAULT_CONFIG = dict(d_model=64, n_layer=4, n_head=4, seq_len=64)
#: AdamW hyper-parameters (nanoGPT-style for a small character model) and the gradient-clip norm.
LR, WEIGHT_DECAY, CLIP_NORM = 3e-3, 0.1, 1.0
#: ``--dtype`` choices mapped to torch dtypes.
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}); use device='cpu' or 'auto'"
        )
    return torch.device(device)


def _say(quiet: bool, *lines: str) -> None:
    if not quiet:
        for line in lines:
            print(line, flush=True)


def run_demo(
    steps: int = DEFAULT_STEPS,
    dtype: str = "float16",
    device: str = "auto",
    out: str | Path = "mpscope-demo",
    every: int = 1,
    quiet: bool = False,
    seed: int = 0,
    batch_size: int = DEFAULT_BATCH,
):
    """Train the demo GPT for ``steps`` optimizer steps under mpscope and report on it.

    Args:
        steps: optimizer steps (each one batch of ``batch_size`` × ``seq_len`` characters), >= 1.
        dtype: autocast dtype, ``"float16"`` (with a ``torch.amp.GradScaler`` at its defaults) or
            ``"bfloat16"`` (no scaler: bf16 has float32's exponent range).
        device: ``"auto"`` (CUDA when ``torch.cuda.is_available()``, else CPU), ``"cpu"``,
            ``"cuda"`` or ``"cuda:N"``.
        out: output directory; receives ``run/`` (the saved :class:`mpscope.Run`, Parquet),
            ``recommended_torch.py`` and ``recommendation.json``.
        every: record every ``every``-th step (``mpscope.record(every=...)``).
        quiet: no progress bar and no printed report (files are still written).
        seed: seeds the weights (``torch.manual_seed``) and the batches (a ``torch.Generator``).
        batch_size: sequences per step.

    Returns:
        The recorded :class:`mpscope.Run`.

    Raises:
        ValueError: bad ``dtype``, ``device``, ``steps``, ``every`` or ``batch_size``.
        FileNotFoundError: the standard library's ``.py`` sources are missing
            (see :func:`mpscope.demo.data.load_text`).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} (e.g. --dtype bfloat16), got {dtype!r}")
    for name, value in (("steps", steps), ("every", every), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    dev = _pick_device(device)
    amp_dtype = DTYPES[dtype]
    out = Path(out)
    t_start = time.perf_counter()

    data = CharDataset.from_stdlib(DEFAULT_CONFIG["seq_len"])
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=data.vocab_size, **DEFAULT_CONFIG)
    model = GPT(config).to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scaler = torch.amp.GradScaler(dev.type) if amp_dtype == torch.float16 else None
    gen = data.generator(seed)
    n_params = sum(p.numel() for p in model.parameters())
    _say(
        quiet,
        f"mpscope demo: character-level GPT ({n_params:,} parameters, d_model={config.d_model}, "
        f"{config.n_layer} layers, {config.n_head} heads, seq_len={config.seq_len}, "
        f"batch {batch_size})",
        f"  data: {len(data.text):,} characters ({data.vocab_size} distinct) of Python's own "
        f"standard library, {len(STDLIB_FILES)} files under {stdlib_dir()}",
        f"  training: {steps} steps of AdamW(lr={LR}) on {dev} under "
        f"torch.autocast({dev.type!r}, {dtype})"
        + (", GradScaler defaults" if scaler is not None else ", no GradScaler")
        + f"; recording every {every} step(s)",
    )

    bar = tqdm(range(steps), desc="training", unit="step", disable=quiet, file=sys.stderr)
    model.train()
    with record(model, optimizer=optimizer, scaler=scaler, every=every) as rec:
        for step in bar:
            x, y = data.batch(batch_size, gen, device=dev)
            with torch.autocast(device_type=dev.type, dtype=amp_dtype):
                _, loss = model(x, y)
            optimizer.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
                optimizer.step()
            if not quiet and (step % 10 == 0 or step == steps - 1):
                postfix = {"loss": f"{loss.item():.3f}"}  # a host sync, outside mpscope's hooks
                if scaler is not None:
                    postfix["scale"] = f"{scaler.get_scale():g}"
                bar.set_postfix(postfix, refresh=False)
    bar.close()
    run = rec.run
    train_s = time.perf_counter() - t_start

    out.mkdir(parents=True, exist_ok=True)
    run.save(out / "run")
    advice = advise(run)
    _say(quiet, "", text_summary(run, advice), "", advice.to_text(), "")
    write_recommendation(advice, out, quiet)
    _say(
        quiet,
        f"run saved to {out / 'run'} (load it with mpscope.Run.load({str(out / 'run')!r})); "
        f"training + recording took {train_s:.1f} s",
    )
    return run


def write_recommendation(advice, out: Path, quiet: bool) -> None:
    """Write the recommendation as a PyTorch snippet and as JSON into ``out``."""
    written = []
    for fmt, name in (("torch", "recommended_torch.py"), ("json", "recommendation.json")):
        advice.export(out / name, format=fmt)
        written.append(str(out / name))
    _say(quiet, "recommended config written to " + " and ".join(written))
