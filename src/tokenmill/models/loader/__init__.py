"""Model loading: resolve a model name, describe its architecture, stream its weights.

Two checkpoint formats are read: a Hugging Face folder (`config.json` + safetensors + tokenizer)
and a single GGUF file (llama.cpp). Both produce a `ModelSource` with HF parameter names.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterator, Optional

import torch
from tqdm import tqdm

from tokenmill.models.arch import ArchConfig
from tokenmill.models.loader.chat_templates import built_in_chat_template
from tokenmill.models.loader.gguf_file import GGUFCheckpoint
from tokenmill.models.loader.hf_config import SUPPORTED_ARCHITECTURES, arch_config_from_hf, served_text_part
from tokenmill.models.loader.mxfp4 import dequantized_mxfp4_stream, mxfp4_names
from tokenmill.models.loader.quantized_checkpoints import packed_layer_stream, packed_scheme, quantization_config
from tokenmill.models.loader.resolve import DEFAULT_MODEL, model_location, resolve_model_path
from tokenmill.models.loader.safetensors_weights import SafetensorsWeights
from tokenmill.models.loader.tokenizer import load_gguf_tokenizer, load_hf_tokenizer
from tokenmill.models.vision.llava import vision_tensor_name

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tokenmill.kernels.quantized import QuantizedWeight

__all__ = [
    "DEFAULT_MODEL",
    "SUPPORTED_ARCHITECTURES",
    "ModelSource",
    "load_model_source",
    "model_location",
    "resolve_model_path",
]

_LM_HEAD = "lm_head.weight"
_EMBEDDING = "model.embed_tokens.weight"
_BASE_EMBEDDING = "embed_tokens.weight"
_MAMBA2_EMBEDDING = "backbone.embeddings.weight"


@dataclass
class ModelSource:
    """Everything needed to build a model: architecture, a weight stream, tokenizer."""

    path: str
    arch: ArchConfig
    tokenizer: Optional["PreTrainedTokenizerBase"]  # None when opened for the weights only
    chat_template: Optional[str]
    num_tensors: int
    # keep_quantized -> (hf_parameter_name, float tensor or QuantizedWeight) pairs
    weight_stream: Callable[[bool], Iterator[tuple[str, "torch.Tensor | QuantizedWeight"]]] = field(repr=False)
    # the checkpoint's quantisation: its quantization_config's quant_method, "gguf", or None (float weights)
    quant_method: Optional[str] = None

    def iter_weights(self, keep_quantized: bool = False) -> Iterator[tuple[str, "torch.Tensor | QuantizedWeight"]]:
        """Yield `(hf_parameter_name, tensor)` pairs, with a progress bar on stderr.

        Float checkpoints keep their stored dtype; dequantized GGUF tensors and packed layers are
        float32. With `keep_quantized`, GGUF matrices whose encoding converts exactly (Q8_0, Q5_0, Q5_1,
        Q5_K, Q6_K, Q4_0, Q4_1, Q4_K) and packed layers that map exactly (quantized_checkpoints.py) come as
        `QuantizedWeight`s instead.
        """
        progress = tqdm(
            self.weight_stream(keep_quantized),
            total=self.num_tensors,
            desc=f"Loading {Path(self.path).name}",
            unit="tensor",
            file=sys.stderr,
        )
        with progress:
            yield from progress


def _hf_folder_source(folder: str, with_tokenizer: bool) -> ModelSource:
    def stored_dtype() -> str:
        weights = SafetensorsWeights(folder)
        return weights.dtype_name_of(_embedding_name(weights.names))

    arch = arch_config_from_hf(folder, stored_dtype)
    weights = SafetensorsWeights(folder)
    names = weights.names
    if arch.vision is not None:
        return _multimodal_source(folder, arch, weights, with_tokenizer, text_only=False)
    if served_text_part(json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))) is not None:
        return _multimodal_source(folder, arch, weights, with_tokenizer, text_only=True)
    if _embedding_name(names) not in names:
        raise ValueError(f"{folder} has no {_EMBEDDING} tensor")
    if _LM_HEAD not in names and not arch.tie_word_embeddings:  # output layer = embedding
        arch = dataclasses.replace(arch, tie_word_embeddings=True)
    wanted = {
        name
        for name in names
        if not name.endswith("rotary_emb.inv_freq")
        and not (name == _LM_HEAD and arch.tie_word_embeddings)
    }
    stream: Callable[[bool], Iterator[tuple[str, Any]]] = lambda keep_quantized: weights.iter_tensors(wanted)
    packing = quantization_config(folder)
    if packing is not None and str(packing.get("quant_method", "")).lower() == "mxfp4":
        # GPT-OSS's MXFP4 experts: dequantised to floats as they load (loader/mxfp4.py)
        stream, wanted = dequantized_mxfp4_stream(weights.iter_tensors, wanted), mxfp4_names(wanted)
    elif packing is not None:  # GPTQ / AWQ / compressed-tensors: one weight per packed layer as it loads
        scheme = packed_scheme(packing, folder, wanted)
        wanted, stream = packed_layer_stream(scheme, wanted, weights.iter_tensors, weights.file_of)
    tokenizer = load_hf_tokenizer(folder) if with_tokenizer else None
    return ModelSource(
        path=folder,
        arch=arch,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template if tokenizer is not None else None,
        num_tensors=len(wanted),
        weight_stream=stream,
        quant_method=None if packing is None else str(packing.get("quant_method", "")).lower(),
    )


def _multimodal_source(folder: str, arch: ArchConfig, weights: SafetensorsWeights, with_tokenizer: bool,
                       text_only: bool) -> ModelSource:
    """A multimodal folder: the decoder's tensors (`language_model.…`) under the names a causal LM gives them, and,
    for a vision-language model, the image side's under 'vision.' (models/vision/llava.py); `text_only` (a
    hf_config.TEXT_PART_ARCHITECTURES checkpoint, Llama 4): the image side's tensors are not read. Float weights
    only."""
    if quantization_config(folder) is not None:
        raise ValueError(f"{folder}: quantised {'multimodal' if text_only else 'vision-language'} checkpoints are "
                         "not supported yet (float weights only)")
    renamed = {name: vision_language_name(name) for name in weights.names}
    if _EMBEDDING not in renamed.values():
        raise ValueError(f"{folder} has no language_model.{'model.' if text_only else ''}embed_tokens.weight tensor")
    if _LM_HEAD not in renamed.values() and not arch.tie_word_embeddings:
        arch = dataclasses.replace(arch, tie_word_embeddings=True)
    # text_only: what maps to a causal LM's name (the image side's tensors keep their own prefixes)
    wanted = {name for name, ours in renamed.items()
              if (not text_only or ((ours.startswith("model.") or ours == _LM_HEAD) and ours != name))
              and not (ours == _LM_HEAD and arch.tie_word_embeddings) and not ours.endswith("rotary_emb.inv_freq")}

    def stream(keep_quantized: bool) -> Iterator[tuple[str, Any]]:
        return ((renamed[name], tensor) for name, tensor in weights.iter_tensors(wanted))

    tokenizer = load_hf_tokenizer(folder) if with_tokenizer else None
    template = tokenizer.chat_template if tokenizer is not None else None  # else the processor's
    return ModelSource(path=folder, arch=arch, tokenizer=tokenizer,
                       chat_template=template or (processor_chat_template(folder) if tokenizer is not None else None),
                       num_tensors=len(wanted), weight_stream=stream)


def processor_chat_template(folder: str) -> Optional[str]:
    """The chat template a vision-language model's processor keeps (llava-hf saves it in chat_template.json,
    not with the tokenizer), or None."""
    path = Path(folder) / "chat_template.json"
    if not path.is_file():
        return None
    try:
        template = json.loads(path.read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    return template if isinstance(template, str) else None


def vision_language_name(name: str) -> str:
    """A vision-language checkpoint's tensor name as the model loads it: 'vision.<tower|projector>.…' for the
    image side, the causal LM's own name ('model.layers.0.…', 'lm_head.weight') for the decoder's."""
    ours = vision_tensor_name(name)
    if ours is not None:
        return "vision." + ours
    for prefix, replacement in (("model.language_model.", "model."), ("language_model.model.", "model."),
                                ("language_model.lm_head.", "lm_head."), ("model.visual.", "vision."),
                                ("visual.", "vision.")):
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name


def _embedding_name(names: Collection[str]) -> str:
    """The embedding table's name: a base model's checkpoint (Qwen3Model, as embedding models save it) names
    its tensors without "model.", which the decoder's loader drops anyway."""
    if _MAMBA2_EMBEDDING in names:  # Mamba2's (models/mamba2.py renames it as it loads)
        return _MAMBA2_EMBEDDING
    return _EMBEDDING if _EMBEDDING in names else _BASE_EMBEDDING


def _gguf_source(path: str, with_tokenizer: bool) -> ModelSource:
    checkpoint = GGUFCheckpoint(path)
    tokenizer = load_gguf_tokenizer(path) if with_tokenizer else None
    return ModelSource(
        path=path,
        arch=checkpoint.arch,
        tokenizer=tokenizer,
        chat_template=(checkpoint.chat_template or (tokenizer.chat_template if tokenizer is not None else None)
                       or built_in_chat_template(checkpoint.gguf_architecture)),
        num_tensors=checkpoint.num_tensors,
        weight_stream=checkpoint.iter_weights,
        quant_method="gguf",
    )


def load_model_source(model: Optional[str], with_tokenizer: bool = True, revision: Optional[str] = None,
                      download_dir: Optional[str] = None, gguf_file: Optional[str] = None) -> ModelSource:
    """Open the checkpoint named by `model` (alias, GGUF file, HF folder or Hub id, the last at `revision`:
    `resolve_model_path`; None = default); a worker that only computes opens it `with_tokenizer=False`."""
    path = resolve_model_path(model, revision, download_dir, gguf_file)
    if Path(path).is_dir():
        if not (Path(path) / "config.json").exists():
            raise ValueError(f"{path} is a folder without config.json (not an HF checkpoint)")
        return _hf_folder_source(path, with_tokenizer)
    if path.endswith(".gguf"):
        return _gguf_source(path, with_tokenizer)
    raise ValueError(f"{path} is neither an HF checkpoint folder nor a .gguf file")
