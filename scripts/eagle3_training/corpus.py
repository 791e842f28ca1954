"""The repository's own text, split into training and held-out files, cut into token windows."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

# what the head learns from: the docs, the README and the package's Python sources
TEXT_GLOBS = ("README.md", "docs/*.md", "src/**/*.py")


def repository_files(root: Path) -> list[Path]:
    """The text files of the repository at `root` (sorted; empty files left out)."""
    files = {path for pattern in TEXT_GLOBS for path in root.glob(pattern) if path.is_file()}
    return sorted(path for path in files if path.stat().st_size > 0)


def is_held_out(path: Path, root: Path, fraction: float) -> bool:
    """Whether a file is held out: a fixed hash of its path relative to `root` (the split does not move when
    other files come or go)."""
    digest = hashlib.sha256(str(path.relative_to(root)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 < fraction


def split_files(root: Path, held_out_fraction: float) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the repository; ValueError when either side is empty."""
    files = repository_files(root)
    train = [f for f in files if not is_held_out(f, root, held_out_fraction)]
    held_out = [f for f in files if is_held_out(f, root, held_out_fraction)]
    if not train or not held_out:
        raise ValueError(f"{len(files)} text files under {root}: the split by --held-out-fraction "
                         f"{held_out_fraction} leaves {len(train)} for training and {len(held_out)} held out")
    return train, held_out


def token_windows(files: list[Path], tokenizer: Any, length: int, count: int, seed: int) -> list[list[int]]:
    """`count` windows of `length` tokens drawn (seeded) from the files' text, at most one per `length` tokens
    of a file and never across two files; fewer when the files hold fewer windows."""
    windows = []
    for path in files:
        ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
        windows.extend(ids[start:start + length] for start in range(0, len(ids) - length + 1, length))
    random.Random(seed).shuffle(windows)
    return windows[:count]
