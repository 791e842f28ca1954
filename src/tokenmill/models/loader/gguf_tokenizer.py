"""AutoTokenizer's tokenizer for a GGUF file, without the full parse of the file that AutoTokenizer makes to choose it.

`AutoTokenizer.from_pretrained(folder, gguf_file=name)` builds a model config from the file only to pick the
tokenizer class, and for most architectures (llama, gemma3, qwen2...; transformers 5.24 reads only qwen35,
qwen35moe and lfm2 the fast way) it does so through `load_gguf_checkpoint`, which parses every metadata value
with the `gguf` package's GGUFReader, one numpy view per vocabulary string: 21 of the 28 CPU seconds of a fresh
conversion of Gemma 3's 262k-token vocabulary (4 of 7 for SmolLM2's 49k). The class it picks depends only on the
config's class (and on a `tokenizer_config.json` beside the file), which the architecture names. Here the
file's metadata is read with transformers' own fast reader, the class is picked by the same rules, and that
class's `from_pretrained` is called with AutoTokenizer's arguments: transformers itself then reads the
vocabulary (with the same fast reader), runs its converter and builds the tokenizer, so the result is
AutoTokenizer's. What remains (7 s for Gemma 3) is that work of transformers: about half of it rebuilding the
merges that Gemma's file does not store (`generate_merges`), then reading the 262k strings and building the class.

Where the choice depends on more than the architecture (a tokenizer_config.json in the folder, T5 files, Mistral's
backends, a config class that names its tokenizer) `UnsupportedGGUFTokenizer` says so, and the caller asks
AutoTokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# the transformers release whose AutoTokenizer the rules below follow (tests/models/test_gguf_tokenizer.py compares
# them with it); another release's may differ, and goes through AutoTokenizer until they are checked against it
VERIFIED_TRANSFORMERS = "5.24."


class UnsupportedGGUFTokenizer(Exception):
    """The fast path cannot tell which class AutoTokenizer would pick for this file: ask AutoTokenizer."""


def load_gguf_tokenizer_directly(gguf_path: str | Path) -> "PreTrainedTokenizerBase":
    """The tokenizer `AutoTokenizer.from_pretrained(folder, gguf_file=name)` builds for `gguf_path`, or
    tokenmill's fallback for an architecture transformers has no GGUF config for (PreTrainedTokenizerFast); raises
    UnsupportedGGUFTokenizer where the choice of class needs AutoTokenizer itself."""
    import transformers

    if not transformers.__version__.startswith(VERIFIED_TRANSFORMERS):
        raise UnsupportedGGUFTokenizer(f"AutoTokenizer's choice was read from transformers {VERIFIED_TRANSFORMERS}")
    from transformers.integrations.gguf import read_gguf_metadata

    path = Path(gguf_path).resolve()
    if (path.parent / "tokenizer_config.json").exists():  # AutoTokenizer reads its tokenizer_class and auto_map
        raise UnsupportedGGUFTokenizer(f"{path.parent} holds a tokenizer_config.json")
    metadata, tensor_names = read_gguf_metadata(str(path))  # string arrays left as counts: milliseconds
    tokenizer_class, from_auto = _tokenizer_class(metadata, tensor_names)
    extra = {"_from_auto": True} if from_auto else {}
    return tokenizer_class.from_pretrained(str(path.parent), gguf_file=path.name, **extra)


def _tokenizer_class(metadata: dict[str, Any], tensor_names: tuple[str, ...]) -> tuple[type, bool]:
    """The class AutoTokenizer (transformers 5.24's models/auto/tokenization_auto.py) picks for a GGUF file in a
    folder without tokenizer_config.json, and whether it is AutoTokenizer's pick (False: the architecture has no
    transformers config, and tokenmill builds a PreTrainedTokenizerFast, as AutoTokenizer cannot)."""
    from transformers import PreTrainedTokenizerFast, TokenizersBackend
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    model_type = _config_model_type(metadata, tensor_names)
    if model_type is None:
        return PreTrainedTokenizerFast, False
    if model_type not in CONFIG_MAPPING:
        raise UnsupportedGGUFTokenizer(f"transformers has no config class for model type {model_type!r}")
    config_class = CONFIG_MAPPING[model_type]
    # a config names a tokenizer class only by a class attribute here (GGUF config dicts have no such key), and
    # AutoTokenizer then weighs that name against the mapping
    if getattr(config_class, "tokenizer_class", None):
        raise UnsupportedGGUFTokenizer(f"{config_class.__name__} names its tokenizer class")
    chosen = TOKENIZER_MAPPING.get(config_class, TokenizersBackend)
    if chosen is None or chosen.__name__ == "MistralCommonBackend":  # an error, or a choice by the folder's files
        raise UnsupportedGGUFTokenizer(f"AutoTokenizer picks {model_type!r}'s tokenizer by more than its config")
    return chosen, True


def _config_model_type(metadata: dict[str, Any], tensor_names: tuple[str, ...]) -> str | None:
    """The model_type of the config AutoTokenizer builds from the file (its GGUF branch: get_gguf_config for the
    architectures in GGUF_CONFIG_ARCHS, else load_gguf_checkpoint's renames), None where load_gguf_checkpoint
    refuses the architecture as not supported."""
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS, get_gguf_config
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    architecture = metadata["general.architecture"]
    if architecture in GGUF_CONFIG_ARCHS:
        return get_gguf_config(metadata, tensor_names)["model_type"]
    if "t5" in architecture:  # its name (umt5 or not) and tensors pick the config: left to AutoTokenizer
        raise UnsupportedGGUFTokenizer(f"GGUF architecture {architecture!r}")
    # load_gguf_checkpoint's renames, in its order; it tests `"mistral" in [general.name]`, i.e. equality
    updated = "mistral" if "llama" in architecture and metadata.get("general.name") == "mistral" else architecture
    for part, renamed in _RENAMED_ARCHITECTURES:
        if part in architecture:
            updated = renamed
            break
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES and updated not in GGUF_SUPPORTED_ARCHITECTURES:
        return None
    # only the text backbone's weights are in a Gemma 3 / Gemma 4 file
    return {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}.get(updated, updated)


# load_gguf_checkpoint's: a GGUF architecture containing the first names the second model type
_RENAMED_ARCHITECTURES = (("qwen2moe", "qwen2_moe"), ("gpt_oss", "gpt_oss"), ("gpt-oss", "gpt_oss"),
                          ("qwen3moe", "qwen3_moe"), ("minimax-m2", "minimax_m2"))
