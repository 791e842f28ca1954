"""Write tiny GGUF checkpoints the way llama.cpp's `convert_hf_to_gguf.py` does.

Weights are random (fixed seed) and generated in HF naming/layout by `tiny_hf_weights`, then
renamed to GGUF names, q/k-permuted for the llama architecture, and encoded in the requested type:
- types gguf-py can quantize (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, ...) via
  `gguf.quants.quantize`;
- other block types (K-quants, which gguf-py only dequantizes) as random blocks whose fp16 scale
  fields are set to small finite values, so they decode to finite weights.
1-D tensors (norms, biases, rope_freqs) stay F32, as in llama.cpp.

The tokenizer is SmolLM2's, copied from the packaged GGUF but cut to its first `VOCAB_SIZE` tokens
(and the merges among them): gguf-py and transformers parse metadata arrays element by element, so
the full 49k-token vocabulary would cost seconds on every open.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable, Optional

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

from tokenmill.models.loader.gguf_file import GGUFCheckpoint
from tokenmill.models.loader.resolve import resolve_model_path

VOCAB_SIZE = 512
HIDDEN_SIZE = 256  # rows must be a multiple of 256 for K-quants
NUM_HEADS = 4
NUM_KV_HEADS = 2
INTERMEDIATE_SIZE = 512
NUM_LAYERS = 2
QWEN3_HEAD_DIM = 128  # transformers' Qwen3Config default, which its GGUF loader relies on
CONTEXT_LENGTH = 256
RMS_NORM_EPS = 1e-5
ROPE_THETA = 10000.0

# Byte offsets of the fp16 scale fields inside one block, for block types gguf-py cannot quantize.
_FP16_SCALE_OFFSETS = {
    GGMLQuantizationType.Q2_K: (80, 82),
    GGMLQuantizationType.Q3_K: (108,),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
}


def head_dim(architecture: str) -> int:
    """The head size of the tiny model of `architecture`."""
    return QWEN3_HEAD_DIM if architecture == "qwen3" else HIDDEN_SIZE // NUM_HEADS


def tiny_hf_weights(
    architecture: str = "llama", tie_word_embeddings: bool = True
) -> dict[str, torch.Tensor]:
    """The float32 weights of the tiny model, with HF names and layout (seeded, so reproducible)."""
    generator = torch.Generator().manual_seed(0)
    dim = head_dim(architecture)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator) * 0.02

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(size, generator=generator)

    weights = {"model.embed_tokens.weight": matrix(VOCAB_SIZE, HIDDEN_SIZE)}
    for i in range(NUM_LAYERS):
        prefix = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": norm(HIDDEN_SIZE),
            "self_attn.q_proj.weight": matrix(NUM_HEADS * dim, HIDDEN_SIZE),
            "self_attn.k_proj.weight": matrix(NUM_KV_HEADS * dim, HIDDEN_SIZE),
            "self_attn.v_proj.weight": matrix(NUM_KV_HEADS * dim, HIDDEN_SIZE),
            "self_attn.o_proj.weight": matrix(HIDDEN_SIZE, NUM_HEADS * dim),
            "post_attention_layernorm.weight": norm(HIDDEN_SIZE),
            "mlp.gate_proj.weight": matrix(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            "mlp.up_proj.weight": matrix(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            "mlp.down_proj.weight": matrix(HIDDEN_SIZE, INTERMEDIATE_SIZE),
        }
        if architecture == "qwen2":
            for proj, heads in (("q", NUM_HEADS), ("k", NUM_KV_HEADS), ("v", NUM_KV_HEADS)):
                bias = 0.1 * torch.randn(heads * dim, generator=generator)
                layer[f"self_attn.{proj}_proj.bias"] = bias
        if architecture == "qwen3":
            layer["self_attn.q_norm.weight"] = norm(dim)
            layer["self_attn.k_norm.weight"] = norm(dim)
        weights.update({prefix + name: value for name, value in layer.items()})
    weights["model.norm.weight"] = norm(HIDDEN_SIZE)
    if not tie_word_embeddings:
        weights["lm_head.weight"] = matrix(VOCAB_SIZE, HIDDEN_SIZE)
    return weights


_GGUF_BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    """The llama.cpp tensor name of HF parameter `hf_name`."""
    if hf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_BLOCK_NAMES[module]}.{kind}"


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: rotate-half rows of each head -> interleaved pairs."""
    grouped = weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def _random_blocks(shape: tuple[int, int], qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    for offset in _FP16_SCALE_OFFSETS.get(qtype, ()):
        scales = rng.uniform(1e-4, 1e-3, size=len(blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block_size * type_size)


def encode(weight: np.ndarray, qtype: GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """`weight` stored as `qtype`: quantized by gguf-py when it can, else random valid blocks."""
    try:
        return gguf.quants.quantize(weight, qtype)
    except NotImplementedError:
        return _random_blocks(weight.shape, qtype, seed)


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer_metadata() -> dict:
    """SmolLM2's tokenizer metadata (packaged GGUF), cut to the first `VOCAB_SIZE` tokens."""
    source = GGUFCheckpoint(resolve_model_path(None))
    tokens = source.metadata("tokenizer.ggml.tokens")[:VOCAB_SIZE]
    kept = set(tokens)

    def within_kept_tokens(merge: str) -> bool:
        left, right = merge.split(" ")
        return left in kept and right in kept and left + right in kept

    merges = list(filter(within_kept_tokens, source.metadata("tokenizer.ggml.merges")))
    return {
        "tokens": tokens,
        "token_types": source.metadata("tokenizer.ggml.token_type")[:VOCAB_SIZE],
        "merges": merges,
        "pre": source.metadata("tokenizer.ggml.pre"),
        "chat_template": source.chat_template,
    }


def _add_tokenizer(writer: gguf.GGUFWriter) -> None:
    tokenizer = smollm2_tokenizer_metadata()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer["pre"])
    writer.add_token_list(tokenizer["tokens"])
    writer.add_token_types(tokenizer["token_types"])
    writer.add_token_merges(tokenizer["merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer["chat_template"])


def _file_type(qtype: GGMLQuantizationType) -> int:
    if qtype == GGMLQuantizationType.F32:
        return gguf.LlamaFileType.ALL_F32
    by_name = {t.name: t for t in gguf.LlamaFileType}
    exact = by_name.get(f"MOSTLY_{qtype.name}")
    return exact or by_name.get(f"MOSTLY_{qtype.name}_M", gguf.LlamaFileType.GUESSED)


def write_tiny_gguf(
    path: str | Path,
    tensor_type: str,
    *,
    architecture: str = "llama",
    tie_word_embeddings: bool = True,
    rope_freqs: bool = False,
    extra_metadata: Optional[Callable[[gguf.GGUFWriter], None]] = None,
) -> Path:
    """Write the tiny model to `path` with its matrices stored as `tensor_type` (e.g. "Q4_K").

    `architecture` is llama, qwen2 or qwen3 (any other name writes llama tensors under that
    architecture name). `rope_freqs` adds a Llama-3 style `rope_freqs.weight` tensor;
    `extra_metadata` adds to the header.
    """
    path = Path(path)
    qtype = GGMLQuantizationType[tensor_type]
    dim = head_dim(architecture)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(f"tiny-{architecture}-{tensor_type}")
    writer.add_vocab_size(VOCAB_SIZE)
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(HIDDEN_SIZE)
    writer.add_block_count(NUM_LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE_SIZE)
    writer.add_rope_dimension_count(dim)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    if architecture == "qwen3":
        writer.add_key_length(dim)
        writer.add_value_length(dim)
    writer.add_layer_norm_rms_eps(RMS_NORM_EPS)
    writer.add_rope_freq_base(ROPE_THETA)
    if extra_metadata is not None:
        extra_metadata(writer)
    writer.add_file_type(_file_type(qtype))
    _add_tokenizer(writer)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    if rope_freqs:
        writer.add_tensor("rope_freqs.weight", np.linspace(1.0, 8.0, dim // 2, dtype=np.float32))
    llama_like = architecture not in ("qwen2", "qwen3")
    weights = tiny_hf_weights("llama" if llama_like else architecture, tie_word_embeddings)
    for seed, (name, weight) in enumerate(weights.items()):
        array = weight.numpy()
        if llama_like and ".q_proj." in name:
            array = llama_cpp_permute(array, NUM_HEADS)
        if llama_like and ".k_proj." in name:
            array = llama_cpp_permute(array, NUM_KV_HEADS)
        if array.ndim == 1:
            writer.add_tensor(gguf_name(name), array)
        else:
            encoded = encode(array, qtype, seed)
            raw_dtype = qtype if encoded.dtype == np.uint8 else None
            writer.add_tensor(gguf_name(name), encoded, raw_dtype=raw_dtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


_MOE_GGUF_ARCHITECTURES = {"MixtralForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3moe",
                           "OlmoeForCausalLM": "olmoe"}
_EXPERT_STACKS = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps",
                  "gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def _float_tensors_of(folder: Path, writer: gguf.GGUFWriter):
    """Mark `writer` as an F32 file with the test tokenizer, then yield (HF name, float32 array) of every
    tensor of `folder`'s safetensors."""
    from safetensors.torch import load_file

    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(writer)
    for file in sorted(folder.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            yield name, tensor.float().numpy()


def _finish(writer: gguf.GGUFWriter, stacks: dict[str, dict[int, np.ndarray]], experts: int) -> None:
    """Add the expert stacks ([experts, rows, cols] each) and write the file out."""
    for name, by_expert in stacks.items():
        writer.add_tensor(name, np.stack([by_expert[e] for e in range(experts)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_moe_gguf_from_hf(folder: str | Path, path: str | Path) -> Path:
    """Convert a tiny HF mixture-of-experts folder (Mixtral, Qwen3-MoE, OLMoE) to an F32 GGUF file as
    llama.cpp's converter does: experts stacked per projection into [experts, rows, cols] tensors, the
    router as `ffn_gate_inp`, Mixtral as a "llama" file with its q/k rows permuted."""
    import json

    folder, path = Path(folder), Path(path)
    config = json.loads((folder / "config.json").read_text())
    architecture = _MOE_GGUF_ARCHITECTURES[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    dim = config.get("head_dim") or config["hidden_size"] // heads
    experts = config.get("num_local_experts") or config["num_experts"]
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(dim)
    writer.add_value_length(dim)
    writer.add_rope_dimension_count(dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, array in _float_tensors_of(folder, writer):
        name = name.replace(".block_sparse_moe.", ".mlp.")
        parts = name.split(".")
        if ".mlp.experts." in name:  # model.layers.L.mlp.experts.E.PROJ.weight
            stacks.setdefault(f"blk.{parts[2]}.{_EXPERT_STACKS[parts[6]]}.weight", {})[int(parts[5])] = array
            continue
        if name.endswith(".mlp.gate.weight"):
            writer.add_tensor(f"blk.{parts[2]}.ffn_gate_inp.weight", array)
            continue
        if architecture == "llama" and ".q_proj." in name:
            array = llama_cpp_permute(array, heads)
        if architecture == "llama" and ".k_proj." in name:
            array = llama_cpp_permute(array, kv_heads)
        writer.add_tensor(gguf_name(name), array)
    _finish(writer, stacks, experts)
    return path


_DEEPSEEK2_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b", "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}  # fmt: skip


def write_deepseek2_gguf_from_hf(folder: str | Path, path: str | Path, split_kv_b: bool = True,
                                 extra_metadata: Optional[Callable[[gguf.GGUFWriter], None]] = None) -> Path:
    """Convert a tiny HF DeepSeek-V2 folder to an F32 GGUF file as llama.cpp's converter does (its
    DeepseekV2Model): experts stacked, `split_kv_b` as newer converters write the attention (one KV head
    of kv_lora_rank + rope, per-head widths in the *_mla keys, kv_b_proj split into attn_k_b, transposed,
    and attn_v_b), else as older ones (per-head widths as key/value lengths, attn_kv_b whole); YaRN as
    rope.scaling.* with yarn_log_multiplier = 0.1 * mscale_all_dim. `extra_metadata` adds to the header."""
    import json

    folder, path = Path(folder), Path(path)
    config = json.loads((folder / "config.json").read_text())
    heads, rank, rope = config["num_attention_heads"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
    experts = config["n_routed_experts"]
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(rope)
    writer.add_kv_lora_rank(rank)
    if config.get("q_lora_rank"):
        writer.add_q_lora_rank(config["q_lora_rank"])
    if split_kv_b:
        writer.add_head_count_kv(1)
        writer.add_key_length(rank + rope)
        writer.add_value_length(rank)
        writer.add_key_length_mla(nope + rope)
        writer.add_value_length_mla(v)
    else:
        writer.add_head_count_kv(heads)
        writer.add_key_length(nope + rope)
        writer.add_value_length(v)
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    rope_parameters = config["rope_parameters"]
    writer.add_rope_freq_base(rope_parameters["rope_theta"])
    if rope_parameters.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope_parameters["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope_parameters["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope_parameters["mscale_all_dim"])
    if extra_metadata is not None:
        extra_metadata(writer)
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, array in _float_tensors_of(folder, writer):
        if name in _GGUF_GLOBAL_NAMES:
            writer.add_tensor(_GGUF_GLOBAL_NAMES[name], array)
            continue
        _, _, layer, rest = name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        if module.startswith("mlp.experts."):  # mlp.experts.E.PROJ
            _, _, expert, projection = module.split(".")
            stacks.setdefault(f"blk.{layer}.{_EXPERT_STACKS[projection]}.weight", {})[int(expert)] = array
            continue
        if module == "self_attn.kv_b_proj" and split_kv_b:
            kv_b = array.reshape(heads, nope + v, rank)
            writer.add_tensor(f"blk.{layer}.attn_k_b.weight", np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)))
            writer.add_tensor(f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:]))
            continue
        writer.add_tensor(f"blk.{layer}.{_DEEPSEEK2_NAMES[module]}.{kind}", array)
    _finish(writer, stacks, experts)
    return path
