"""GGUF tensor names and encodings -> HF parameter names and torch tensors."""

from __future__ import annotations

import re
from typing import Union

import numpy as np
import torch
from gguf import GGMLQuantizationType, ReaderTensor
from gguf import quants

from tokenmill.kernels.quantized import QuantizedWeight

T = GGMLQuantizationType
FLOAT_TYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
QUANTIZED_TYPES = frozenset(
    {
        T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
        T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
        T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS,
        T.TQ1_0, T.TQ2_0,
    }
)  # fmt: skip
SUPPORTED_TENSOR_TYPES = frozenset(FLOAT_TYPES) | QUANTIZED_TYPES

ROPE_FREQS = "rope_freqs"
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": ROPE_FREQS,
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
}
# a mixture of experts' stacked expert matrices ([experts, rows, cols]): one HF matrix per expert
EXPERT_PARTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# DeepSeek-V2's kv_b_proj as newer llama.cpp converters split it: per head, the key part transposed
# ([heads, rank, nope]) and the value part ([heads, v, rank]); `GGUFCheckpoint` joins them again
KV_B_PARTS = {"attn_k_b": "self_attn.kv_b_proj.keys", "attn_v_b": "self_attn.kv_b_proj.values"}
# where an architecture names a tensor differently (Gemma 3 has norms before and after each block) or
# has tensors of its own (DeepSeek-V2's latent attention and shared experts)
_ARCH_BLOCK_NAMES = {
    "gemma3": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "deepseek2": {
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",
        **KV_B_PARTS,
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
    },
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, architecture: str = "llama") -> str:
    """The HF parameter name of GGUF tensor `gguf_name` (e.g. `blk.3.attn_q.weight`) in a file of GGUF
    `architecture`."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(architecture, {})}
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in {**names, **EXPERT_PARTS}:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in the supported {architecture} models")
    layer, part, kind = match.groups()
    if part in EXPERT_PARTS:  # one name per expert: expert_name(..., expert)
        return f"model.layers.{layer}.mlp.experts.{{}}.{EXPERT_PARTS[part]}.{kind}"
    return f"model.layers.{layer}.{names[part]}.{kind}"


def is_expert_stack(gguf_name: str) -> bool:
    """Whether `gguf_name` holds every expert's matrix of one projection, stacked."""
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    return match is not None and match.group(2) in EXPERT_PARTS


def check_tensor_type(tensor: ReaderTensor) -> None:
    """Raise ValueError when `tensor` is stored in an encoding the loader cannot decode."""
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}; "
            f"supported: {supported}"
        )


def to_torch(tensor: ReaderTensor) -> torch.Tensor:
    """Decode `tensor` in HF layout ([out, in]); float types keep their dtype, others -> float32."""
    return to_torch_data(tensor.data, tensor.tensor_type)


def to_torch_data(data: np.ndarray, tensor_type: GGMLQuantizationType) -> torch.Tensor:
    """Decode a tensor's raw `data` of `tensor_type` (or a slice of it along its leading dimensions)."""
    if tensor_type == T.BF16:
        return torch.from_numpy(np.array(data).view(np.int16)).view(torch.bfloat16)
    if tensor_type in FLOAT_TYPES:
        return torch.from_numpy(np.array(data))
    return torch.from_numpy(dequantize(data, tensor_type))


# values a dequantising pass decodes at once: 1 MB of float32, whose temporaries stay in cache (gguf's own
# dequantize goes 16 rows at a time; measured on the default model's weights, passes of 256k values took 0.9 s,
# of 1M-4M 0.9-2.0 s, gguf's 2.2 s)
_DEQUANTIZE_VALUES = 1 << 18


def dequantize(data: np.ndarray, tensor_type: GGMLQuantizationType) -> np.ndarray:
    """gguf's dequantize of `data` (raw bytes, rows in its last dimension), bit for bit: the same per-block
    arithmetic (each block is decoded on its own) over passes of about _DEQUANTIZE_VALUES values instead of
    16 rows, whose numpy calls on small arrays made most of its time (the default model's weights decode in
    0.9 s instead of 2.2, Gemma 3 270M's in 1.0 instead of 3.0)."""
    codec = getattr(quants, tensor_type.name, None)
    if codec is None or getattr(codec, "qtype", None) != tensor_type or data.ndim == 0:
        return quants.dequantize(data, tensor_type)
    codec.init_grid()
    rows = data.view(np.uint8).reshape(-1, data.shape[-1])
    shape = quants.quant_shape_from_byte_shape(data.shape, tensor_type)
    per_pass = max(1, _DEQUANTIZE_VALUES // max(1, shape[-1]))
    out = np.empty((rows.shape[0], shape[-1]), dtype=np.float32)
    for first in range(0, rows.shape[0], per_pass):
        out[first:first + per_pass] = codec.dequantize_rows(rows[first:first + per_pass])
    return out.reshape(shape)


def undo_llama_rope_permute(weight: Union[torch.Tensor, QuantizedWeight], num_heads: int):
    """Invert the row permutation llama.cpp's converter applies to Llama q/k projections.

    The converter regroups each head's rows from HF's rotate-half order into interleaved pairs;
    this is transformers' `reverse_permute_weights`. Works for weights, biases and quantised weights.
    """
    if isinstance(weight, QuantizedWeight):
        return weight.index_rows(undo_llama_rope_permute(torch.arange(weight.shape[0]), num_heads))
    half_head = weight.shape[0] // num_heads // 2
    grouped = weight.reshape(num_heads, half_head, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape).contiguous()
