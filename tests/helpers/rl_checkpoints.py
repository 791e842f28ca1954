"""The checkpoints an RL test updates between: a tiny Llama written without transformers, the same model with
every tensor moved (new weights), and one whose LM head lacks a row (another shape)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from helpers.agreeing_drafts import write_bigram_llama


def variant(source: Path, folder: Path, change) -> str:
    """A copy of checkpoint `source` in `folder` with its tensors passed through `change(name, tensor)`."""
    shutil.copytree(source, folder)
    tensors = load_file(str(source / "model.safetensors"))
    save_file({name: change(name, tensor) for name, tensor in tensors.items()}, str(folder / "model.safetensors"))
    return str(folder)


def write_rl_checkpoints(root: Path, seed: int = 5) -> tuple[str, str, str]:
    """(old, new, narrower) folders under `root`: new's tensors are old's times 1 + 0.5 N(0, 1) noise of `seed`."""
    old = write_bigram_llama(root / "old")
    noise = torch.Generator().manual_seed(seed)
    new = variant(old, root / "new", lambda name, t: t * (1 + 0.5 * torch.randn(t.shape, generator=noise)))
    narrower = variant(old, root / "narrower", lambda name, t: t[:-1] if name == "lm_head.weight" else t)
    return str(old), new, narrower
