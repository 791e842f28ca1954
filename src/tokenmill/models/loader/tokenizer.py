"""Fast tokenizers for HF folders and GGUF files, with GGUF conversions cached on disk.

transformers needs seconds to build a tokenizer from GGUF metadata, so the result is saved with
`save_pretrained` under `$TOKENMILL_CACHE_DIR/tokenizers/<key>` (default `~/.cache/tokenmill`)
and reloaded from there; the key changes whenever the GGUF file's path, size or mtime does.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill import envs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

def gguf_tokenizer_cache_dir(gguf_path: str | Path) -> Path:
    """The folder where the tokenizer converted from `gguf_path` is (or will be) cached."""
    path = Path(gguf_path).resolve()
    stat = path.stat()
    identity = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return envs.cache_root() / "tokenizers" / f"{path.stem}-{key}"


def load_hf_tokenizer(folder: str | Path) -> "PreTrainedTokenizerBase":
    """The tokenizer saved in an HF checkpoint folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _save_atomically(tokenizer: "PreTrainedTokenizerBase", target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tokenizer.save_pretrained(str(staging))
        os.replace(staging, target)
    except OSError:
        if not target.exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_gguf_tokenizer(gguf_path: str | Path) -> "PreTrainedTokenizerBase":
    """The tokenizer described by a GGUF file's metadata, converted once and then cached."""
    from transformers import AutoTokenizer

    cached = gguf_tokenizer_cache_dir(gguf_path)
    if cached.is_dir():
        return AutoTokenizer.from_pretrained(str(cached))
    path = Path(gguf_path).resolve()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except ValueError as exc:
        if "is not supported" not in str(exc):
            raise
        # transformers reads GGUF configs of some architectures only (not OLMoE's), but converts any
        # file's tokenizer metadata: build the tokenizer without the config
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    _save_atomically(tokenizer, cached)
    return tokenizer
