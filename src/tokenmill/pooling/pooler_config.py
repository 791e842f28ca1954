"""How an embedding model turns token states into one vector: read from its sentence-transformers files.

A sentence-transformers folder lists its modules in `modules.json`: the Transformer, then a Pooling
module (its folder's `config.json` names the mode), optionally Dense, then optionally Normalize.
`sentence_bert_config.json` holds the longest input the model was trained on (`max_seq_length`).
A folder without them pools as vLLM's defaults do: CLS for encoders, the last token for decoders,
normalised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from tokenmill.config import ModelConfig
from tokenmill.models.loader.resolve import model_location, resolve_model_path

POOLING_METHODS = ("mean", "cls", "last")
ENCODER_ARCHITECTURES = ("BertModel", "RobertaModel", "XLMRobertaModel")


@dataclass(frozen=True)
class PoolerConfig:
    """method: mean (over the sequence's tokens), cls (the first token) or last (the last token);
    normalize: scale to unit L2 norm; max_seq_length: the longest input (None: the model's positions);
    matryoshka: whether the model was trained so that its vectors' leading dimensions stand alone
    (then a request may ask for fewer `dimensions`)."""

    method: str
    normalize: bool
    max_seq_length: Optional[int]
    matryoshka: bool = False

    def __post_init__(self) -> None:
        if self.method not in POOLING_METHODS:
            raise ValueError(f"pooling method must be one of {', '.join(POOLING_METHODS)}, got {self.method!r}")


def is_sentence_transformers_folder(folder: str) -> bool:
    """Whether `folder` holds a sentence-transformers model (its `modules.json`)."""
    return (Path(folder) / "modules.json").is_file()


def read_pooler_config(folder: str, hf_config: dict[str, Any], encoder: bool) -> PoolerConfig:
    """The pooling of the model in `folder` (`hf_config`: its config.json). ValueError for a module this
    engine does not run (a Dense projection, max or sqrt-length pooling)."""
    root = Path(folder)
    matryoshka = bool(hf_config.get("is_matryoshka") or hf_config.get("matryoshka_dimensions"))
    if not is_sentence_transformers_folder(folder):
        return PoolerConfig("cls" if encoder else "last", True, None, matryoshka)
    modules = json.loads((root / "modules.json").read_text())
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]  # the class, wherever its module is
    unsupported = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
    if unsupported:
        raise ValueError(f"{folder}: sentence-transformers modules {unsupported} are not supported "
                         "(supported: Transformer, Pooling, Normalize)")
    method = "cls" if encoder else "last"
    pooling = next((m for m, kind in zip(modules, kinds) if kind == "Pooling"), None)
    if pooling is not None:
        method = _pooling_method(json.loads((root / pooling.get("path", "") / "config.json").read_text()), folder)
    bert_config = root / "sentence_bert_config.json"
    max_len = json.loads(bert_config.read_text()).get("max_seq_length") if bert_config.is_file() else None
    return PoolerConfig(method, "Normalize" in kinds, max_len, matryoshka)


def _pooling_method(config: dict[str, Any], folder: str) -> str:
    if "pooling_mode" in config:  # sentence-transformers >= 5 writes the mode by name
        named = {"mean": "mean", "cls": "cls", "lasttoken": "last"}.get(config["pooling_mode"])
        if named is None:
            raise ValueError(f"{folder}: pooling mode {config['pooling_mode']!r} is not supported "
                             "(supported: mean, cls, lasttoken)")
        return named
    modes = [mode for mode, on in config.items() if mode.startswith("pooling_mode_") and on]
    names = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
    if len(modes) != 1 or modes[0] not in names:
        raise ValueError(f"{folder}: pooling {modes} is not supported (one of mean_tokens, cls_token, lasttoken)")
    return names[modes[0]]


def is_pooling_model(model_path: str) -> bool:
    """Whether the checkpoint at `model_path` is an embedding model: an encoder's HF folder, or any HF
    folder with sentence-transformers modules (a decoder trained for embeddings)."""
    folder = Path(model_path)
    if not (folder / "config.json").is_file():
        return False
    architectures = json.loads((folder / "config.json").read_text()).get("architectures") or []
    return is_sentence_transformers_folder(model_path) or any(a in ENCODER_ARCHITECTURES for a in architectures)


def runs_pooling(model: ModelConfig) -> bool:
    """Whether `model` embeds (the pooling runner) rather than generates; ValueError if its path is bad."""
    if model.runner != "auto":
        return model.runner == "pooling"
    return is_pooling_model(resolve_model_path(model.model, **model_location(model)))
