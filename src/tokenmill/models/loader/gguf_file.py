"""A GGUF checkpoint: architecture from its metadata, HF-named tensors (float or kept quantised) from its data."""

from __future__ import annotations

import struct
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType

from tokenmill.kernels.quantized import EXACT_GGUF_FORMATS, QuantizedWeight, from_gguf
from tokenmill.models.arch import FULL_ATTENTION, SLIDING_ATTENTION, ArchConfig, MLAConfig, MoEConfig, RopeScaling
from tokenmill.models.loader.hf_config import yarn_mscale
from tokenmill.models.loader.gguf_tensors import (
    FLOAT_TYPES,
    check_tensor_type,
    hf_name,
    is_expert_stack,
    to_torch,
    to_torch_data,
    undo_llama_rope_permute,
)

GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek2": "DeepseekV2ForCausalLM",
}
# a file of these architectures with experts is of another HF architecture (llama.cpp writes Mixtral as "llama")
GGUF_EXPERT_ARCHITECTURES = {"llama": "MixtralForCausalLM"}
# llama.cpp's routing per architecture (its build_moe_ffn's norm_w): whether the top k weights are
# renormalised. A "llama" file with experts is Mixtral.
_TOPK_RENORMALISED = {"llama": True, "qwen3moe": True, "olmoe": False, "deepseek2": False}
_SOFTMAX_GATING = 1  # llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid
# llama.cpp's Gemma 3 settings that the file does not store (src/llama-model.cpp): every sixth layer
# is global, the local layers' RoPE base
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10_000.0
_MISSING = object()


class _FastGGUFReader(GGUFReader):
    """A GGUFReader that reads metadata arrays in one pass instead of one numpy slice per element.

    GGUFReader slices the file two or three times per metadata array element (~150k slices for
    SmolLM2's 49k-token vocabulary, ~800k for Gemma 3's 262k), microseconds each: opening SmolLM2 took
    1.1 s and Gemma 3 4.9 s. Here an array of numbers is one ndarray view and an array of strings is
    one memoryview slice per string. Nothing is copied: every part still views the memory map.

    Invariant this relies on: an array field's parts are read only through `ReaderField.contents()`
    with no index (all elements), which is how `GGUFCheckpoint.metadata` reads them; an array of
    numbers has one data part holding every element, so `contents(i)` is not supported for it.
    """

    _plain_data: Optional[np.ndarray] = None

    def _plain(self) -> np.ndarray:
        """The memory map as a plain ndarray (slicing an np.memmap costs microseconds more)."""
        if self._plain_data is None:
            self._plain_data = self.data.view(np.ndarray)
        return self._plain_data

    def _get(self, offset, dtype, count=1, override_order=None):  # type: ignore[override]
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        array = self._plain()[offset:end].view(dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return array.view(array.dtype.newbyteorder(order))

    def _get_field_parts(self, orig_offs, raw_type):  # type: ignore[override]
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        length = self._get(orig_offs + 4, np.uint64)
        offs = orig_offs + 12
        item_type = GGUFValueType(int(raw_itype[0]))
        parts: list[Any] = [raw_itype, length]
        if item_type == GGUFValueType.STRING:
            data, unpack = memoryview(self._plain()), struct.Struct("<Q").unpack_from
            for _ in range(int(length[0])):
                (size,) = unpack(data, offs)
                parts.append(data[offs + 8:offs + 8 + size])
                offs += 8 + size
            return offs - orig_offs, parts, list(range(2, len(parts))), [GGUFValueType.ARRAY, item_type]
        item_dtype = self.gguf_scalar_to_np.get(item_type)
        if item_dtype is None:  # arrays of arrays: the library's own walk
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, item_dtype, length[0])
        parts.append(values)
        return 12 + int(values.nbytes), parts, [2], [GGUFValueType.ARRAY, item_type]


class GGUFCheckpoint:
    """An open GGUF file whose architecture, tensor names and tensor types have been checked.

    `arch` is the `ArchConfig` read from the metadata and tensor set. The file is memory-mapped;
    tensors are decoded one at a time by `iter_weights`.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reader = _FastGGUFReader(self.path)
        self.gguf_architecture = self.metadata("general.architecture")
        if self.gguf_architecture not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"unsupported GGUF architecture {self.gguf_architecture!r} in {self.path}; "
                f"supported: {', '.join(GGUF_ARCHITECTURES)}"
            )
        self.tensors = {tensor.name: tensor for tensor in self.reader.tensors}
        for tensor in self.reader.tensors:
            hf_name(tensor.name, self.gguf_architecture)
            check_tensor_type(tensor)
        self.arch = self._read_arch_config()

    def metadata(self, key: str, default: Any = _MISSING) -> Any:
        """The value of metadata `key` (scalars as Python values, arrays as lists)."""
        field = self.reader.get_field(key)
        if field is None:
            if default is _MISSING:
                raise ValueError(f"GGUF file {self.path} lacks metadata {key!r}")
            return default
        return field.contents()

    def _arch_metadata(self, key: str, default: Any = _MISSING) -> Any:
        return self.metadata(f"{self.gguf_architecture}.{key}", default)

    @property
    def chat_template(self) -> Optional[str]:
        """The chat template stored in the file, if any."""
        return self.metadata("tokenizer.chat_template", None)

    @property
    def num_tensors(self) -> int:
        """How many tensors `iter_weights` yields (a stack of experts' matrices yields one per expert)."""
        joined = sum(1 for t in self.reader.tensors if ".attn_v_b." in t.name)  # attn_k_b + attn_v_b: one kv_b_proj
        return sum(int(t.shape[-1]) if is_expert_stack(t.name) else 1 for t in self.reader.tensors) - joined

    def _rope_scaling(self) -> Optional[RopeScaling]:
        if "rope_freqs.weight" in self.tensors:
            return RopeScaling(kind="factors")
        kind = self._arch_metadata("rope.scaling.type", "none")
        if kind == "none":
            return None
        if kind == "linear":
            factor = float(self._arch_metadata("rope.scaling.factor"))
            return RopeScaling(kind="linear", factor=factor)
        if kind == "yarn":
            factor = float(self._arch_metadata("rope.scaling.factor"))
            return RopeScaling(kind="yarn", factor=factor,
                               original_max_position_embeddings=int(self._arch_metadata("rope.scaling.original_context_length")),
                               beta_fast=float(self._arch_metadata("rope.scaling.yarn_beta_fast", 32.0)),
                               beta_slow=float(self._arch_metadata("rope.scaling.yarn_beta_slow", 1.0)),
                               attention_factor=self._yarn_attention_factor(factor))
        raise ValueError(f"unsupported GGUF RoPE scaling type {kind!r}; supported: none, linear, yarn")

    def _yarn_log_multiplier(self) -> float:
        """YaRN's mscale_all_dim, which llama.cpp's converter stores times 0.1 (0: not given)."""
        return float(self._arch_metadata("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1

    def _yarn_attention_factor(self, factor: float) -> float:
        """The magnitude of cos and sin as llama.cpp's YaRN leaves it (llama_context's yarn_attn_factor
        times ggml's own 1 + 0.1 ln(factor)): mscale(factor, m) / mscale(factor, mscale_all_dim) with m = 1,
        or m = mscale_all_dim for DeepSeek-V2, else mscale(factor); times rope.scaling.attn_factor."""
        all_dim = self._yarn_log_multiplier()
        if all_dim:
            mscale = all_dim if self.gguf_architecture == "deepseek2" and all_dim != 1.0 else 1.0
            magnitude = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
        else:
            magnitude = yarn_mscale(factor)
        return magnitude * float(self._arch_metadata("rope.scaling.attn_factor", 1.0))

    def _eos_token_ids(self) -> tuple[int, ...]:
        keys = ("eos_token_id", "eot_token_id", "eom_token_id")
        ids = [self.metadata(f"tokenizer.ggml.{key}", None) for key in keys]
        if self.gguf_architecture == "gemma3" and ids[1] is None:
            # Gemma's chat turns end with <end_of_turn>, which its GGUF files do not name as eot
            tokens = self.metadata("tokenizer.ggml.tokens", [])
            ids.append(tokens.index("<end_of_turn>") if "<end_of_turn>" in tokens else None)
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

    def _checkpoint_dtype(self) -> str:
        matrix_types = {t.tensor_type for t in self.reader.tensors if len(t.shape) == 2}
        if len(matrix_types) == 1 and (only := matrix_types.pop()) in FLOAT_TYPES:
            return str(FLOAT_TYPES[only]).removeprefix("torch.")
        return "float32"

    def _gemma3_fields(self, num_layers: int, hidden_size: int, head_dim: int) -> dict[str, Any]:
        """Gemma 3's ArchConfig fields beyond the Llama ones. The converter stores the norms' weights
        with Gemma's + 1 already added, so no offset remains."""
        if self._arch_metadata("attn_logit_softcapping", None) is not None:
            raise ValueError("Gemma 3 with attention logit soft-capping is not supported")
        layer_types = tuple(FULL_ATTENTION if (i + 1) % _GEMMA3_SLIDING_PATTERN == 0 else SLIDING_ATTENTION
                            for i in range(num_layers))
        cap = self._arch_metadata("final_logit_softcapping", None)
        return dict(layer_types=layer_types, rope_local_theta=_GEMMA3_LOCAL_ROPE_BASE, hidden_act="gelu_tanh",
                    sandwich_norms=True, embedding_scale=float(hidden_size) ** 0.5,
                    attention_scale=float(head_dim) ** -0.5, final_logit_softcap=float(cap) if cap else None)

    def _moe_fields(self, num_layers: int) -> dict[str, Any]:
        """The mixture of experts (Mixtral, Qwen3-MoE, OLMoE): experts in the layers that have a router."""
        num_experts = self._arch_metadata("expert_count", 0)
        if not num_experts:
            return {}
        if self.gguf_architecture not in _TOPK_RENORMALISED:
            raise ValueError(f"GGUF {self.gguf_architecture} with experts is not supported; supported: "
                             f"{', '.join(_TOPK_RENORMALISED)}")
        deepseek = self.gguf_architecture == "deepseek2"
        shared = int(self._arch_metadata("expert_shared_count", 0))
        if not deepseek and (shared or self._arch_metadata("expert_shared_feed_forward_length", 0)):
            raise ValueError(f"GGUF {self.gguf_architecture} with shared experts is not supported")
        for key, supported in (("expert_gating_func", _SOFTMAX_GATING), ("expert_group_count", 1)):
            value = self._arch_metadata(key, supported)
            if value != supported and (key != "expert_group_count" or value > 1 and self._arch_metadata(
                    "expert_group_used_count", value) < value):
                raise ValueError(f"GGUF {self.gguf_architecture} with {key}={value} is not supported; "
                                 f"supported: {supported} (softmax routing over all experts)")
        width = self._arch_metadata("expert_feed_forward_length", None) or self._arch_metadata("feed_forward_length")
        normalise = self._arch_metadata("expert_weights_norm", _TOPK_RENORMALISED[self.gguf_architecture])
        dense = frozenset(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in self.tensors)
        fields: dict[str, Any] = dict(moe=MoEConfig(
            num_experts=int(num_experts), top_k=int(self._arch_metadata("expert_used_count")),
            intermediate_size=int(width), norm_topk_prob=bool(normalise), dense_layers=dense,
            routed_scaling_factor=float(self._arch_metadata("expert_weights_scale", 1.0)),
            shared_intermediate_size=shared * int(width)))
        if self.gguf_architecture in GGUF_EXPERT_ARCHITECTURES:
            fields["architecture"] = GGUF_EXPERT_ARCHITECTURES[self.gguf_architecture]
        if self.gguf_architecture == "olmoe":
            fields["qk_norm_per_head"] = False  # its q/k norms span the whole projections
        return fields

    def _deepseek2_fields(self, num_heads: int) -> dict[str, Any]:
        """DeepSeek-V2's latent attention. Newer converters store the attention as llama.cpp runs it, one
        KV head of key_length = kv_lora_rank + rope and value_length = kv_lora_rank, with the per-head
        widths in key_length_mla / value_length_mla; older ones store the per-head widths as key_length /
        value_length. The softmax scale is (nope + rope) ** -0.5 times yarn's mscale(factor,
        mscale_all_dim) squared, as llama.cpp's kq_scale."""
        rank, rope = int(self._arch_metadata("attention.kv_lora_rank")), int(self._arch_metadata("rope.dimension_count"))
        qk = int(self._arch_metadata("attention.key_length_mla", None) or self._arch_metadata("attention.key_length"))
        v = int(self._arch_metadata("attention.value_length_mla", None) or self._arch_metadata("attention.value_length"))
        q_rank = int(self._arch_metadata("attention.q_lora_rank", 0))
        if qk <= rope:
            raise ValueError(f"GGUF deepseek2 key length {qk} must exceed its RoPE dimension {rope}")
        scale = qk ** -0.5
        if self._arch_metadata("rope.scaling.type", "none") == "yarn":
            factor = float(self._arch_metadata("rope.scaling.factor"))
            attention_factor = self._yarn_attention_factor(factor)
            scale *= (attention_factor * yarn_mscale(factor, self._yarn_log_multiplier())) ** 2
        mla = MLAConfig(kv_lora_rank=rank, qk_nope_head_dim=qk - rope, qk_rope_head_dim=rope, v_head_dim=v,
                        q_lora_rank=q_rank or None)
        return dict(mla=mla, head_dim=qk, num_key_value_heads=num_heads, attention_scale=scale)

    def _read_arch_config(self) -> ArchConfig:
        hidden_size = int(self._arch_metadata("embedding_length"))
        num_heads = int(self._arch_metadata("attention.head_count"))
        head_dim = self._arch_metadata("attention.key_length", None)
        head_dim = int(head_dim) if head_dim is not None else hidden_size // num_heads
        num_layers = int(self._arch_metadata("block_count"))
        sliding_window = self._arch_metadata("attention.sliding_window", None)
        bos = self.metadata("tokenizer.ggml.bos_token_id", None)
        gemma3 = self.gguf_architecture == "gemma3"
        fields = {"architecture": GGUF_ARCHITECTURES[self.gguf_architecture], **self._moe_fields(num_layers),
                  "num_key_value_heads": int(self._arch_metadata("attention.head_count_kv", num_heads)),
                  "head_dim": head_dim}
        if self.gguf_architecture == "deepseek2":
            fields.update(self._deepseek2_fields(num_heads))
        return ArchConfig(
            **(self._gemma3_fields(num_layers, hidden_size, head_dim) if gemma3 else {}),
            **fields,
            vocab_size=int(self.tensors["token_embd.weight"].shape[1]),
            hidden_size=hidden_size,
            intermediate_size=int(self._arch_metadata("feed_forward_length")),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            rms_norm_eps=float(self._arch_metadata("attention.layer_norm_rms_epsilon")),
            rope_theta=float(self._arch_metadata("rope.freq_base", 10000.0)),
            max_position_embeddings=int(self._arch_metadata("context_length")),
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            attention_out_bias="blk.0.attn_output.bias" in self.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self.tensors,
            rope_scaling=self._rope_scaling(),
            sliding_window=int(sliding_window) if sliding_window is not None else None,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=self._eos_token_ids(),
            checkpoint_dtype=self._checkpoint_dtype(),
        )

    def _heads_of_permuted_rows(self, gguf_name: str) -> Optional[int]:
        """Head count to un-permute `gguf_name` with, or None if llama.cpp did not permute it."""
        if self.gguf_architecture != "llama":
            return None
        if ".attn_q." in gguf_name:
            return self.arch.num_attention_heads
        if ".attn_k." in gguf_name:
            return self.arch.num_key_value_heads
        return None

    def iter_weights(self, keep_quantized: bool = False) -> Iterator[tuple[str, "torch.Tensor | QuantizedWeight"]]:
        """Yield `(hf_name, tensor)` for every tensor in HF layout: decoded to float, or with
        `keep_quantized` converted into a `QuantizedWeight` where the encoding allows it exactly."""
        kv_b_parts: dict[str, torch.Tensor] = {}  # one layer's attn_k_b / attn_v_b until both are read
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name, self.gguf_architecture)
            if is_expert_stack(tensor.name):  # [experts, rows, cols]: one matrix per expert
                for expert in range(int(tensor.shape[-1])):
                    yield name.format(expert), self._matrix(tensor, keep_quantized, expert)
                continue
            if ".kv_b_proj.keys." in name or ".kv_b_proj.values." in name:
                kv_b_parts[name] = to_torch(tensor).float()
                joined = self._joined_kv_b(name.split(".kv_b_proj.")[0] + ".kv_b_proj", kv_b_parts)
                if joined is not None:
                    yield joined
                continue
            weight = self._matrix(tensor, keep_quantized) if len(tensor.shape) == 2 else to_torch(tensor)
            num_heads = self._heads_of_permuted_rows(tensor.name)
            if num_heads is not None:
                weight = undo_llama_rope_permute(weight, num_heads)
            yield name, weight

    @staticmethod
    def _joined_kv_b(name: str, parts: dict[str, torch.Tensor]) -> Optional[tuple[str, torch.Tensor]]:
        """`name`.weight ([heads * (nope + v), rank], HF's kv_b_proj) from its key part ([heads, rank,
        nope]) and value part ([heads, v, rank]) once both are in `parts` (which gives them up)."""
        keys, values = parts.get(f"{name}.keys.weight"), parts.get(f"{name}.values.weight")
        if keys is None or values is None:
            return None
        del parts[f"{name}.keys.weight"], parts[f"{name}.values.weight"]
        if keys.dim() != 3 or values.dim() != 3 or keys.shape[:2] != (values.shape[0], values.shape[2]):
            raise ValueError(f"GGUF {name} parts do not fit together: keys {tuple(keys.shape)}, "
                             f"values {tuple(values.shape)}")
        return f"{name}.weight", torch.cat((keys.transpose(1, 2), values), dim=1).reshape(-1, keys.shape[1])

    @staticmethod
    def _matrix(tensor: Any, keep_quantized: bool, expert: Optional[int] = None) -> "torch.Tensor | QuantizedWeight":
        """A matrix (expert `expert`'s of a stack) decoded to float, or kept as a `QuantizedWeight` where
        the encoding allows."""
        data = np.asarray(tensor.data) if expert is None else np.asarray(tensor.data)[expert]
        if keep_quantized and tensor.tensor_type in EXACT_GGUF_FORMATS:
            return from_gguf(tensor.tensor_type, data, cols=int(tensor.shape[0]))
        return to_torch_data(data, tensor.tensor_type)
