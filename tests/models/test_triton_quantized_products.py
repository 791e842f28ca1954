"""Quantised checkpoints served on the Triton weight-only products (`linear_kernel="triton"`, Triton's
interpreter on CPU tensors): GPTQ in activation order, AWQ, compressed-tensors W4A16 and a GGUF Q6_K (int8
with sub-scales, its tied embedding looked up through the head's product) stay packed and give HF
transformers float32's greedy tokens on the same weights dequantised. The interpreter runs each kernel
program in Python: two short prompts and two tokens keep each engine at a few seconds."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.engine_probe import assert_greedy_matches_hf
from helpers.packed_checkpoints import write_compressed, write_pair
from helpers.tiny_gguf import write_tiny_gguf
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM
from tokenmill.layers.linear import _ShardedLinear
from tokenmill.layers.triton_quant_linear import TritonQuantizedProduct

# not batch-invariant: the float LM head then stays a plain F.linear (batch-invariant, it would take the Triton
# dense product), and the quantised products take both tilings (prompts past 16 tokens, decodes of 2 rows)
ENGINE = dict(dtype="float32", linear_kernel="triton", attention_backend="torch_ref", batch_invariant=False,
              num_kv_blocks=64, max_model_len=128)
PROMPTS = [[1, 52, 95, 42], list(range(100, 400, 7))]  # within the tiny GGUF's 512 tokens; the second past 16


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")


def _gptq_act_order(base, folder):
    packed, floats = write_pair(base, folder, "gptq", 4, act_order=True)
    return packed, AutoModelForCausalLM.from_pretrained(str(floats), dtype=torch.float32).eval()


def _awq(base, folder):
    packed, floats = write_pair(base, folder, "awq", 4, group_size=64)
    return packed, AutoModelForCausalLM.from_pretrained(str(floats), dtype=torch.float32).eval()


def _compressed_w4a16(base, folder):
    floats = write_compressed(base, folder / "w4a16", "W4A16")
    return folder / "w4a16", AutoModelForCausalLM.from_pretrained(str(floats), dtype=torch.float32).eval()


def _gguf_q6_k(base, folder):
    """HF's float32 Llama on the GGUF's weights as the loader dequantises them, which test_loaders proves
    equal to transformers' own GGUF loading (that loading costs ~10 s of metadata parsing per file)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers import tiny_gguf
    from tokenmill.models.loader import load_model_source

    path = write_tiny_gguf(folder / "tiny-Q6_K.gguf", "Q6_K")
    config = LlamaConfig(vocab_size=tiny_gguf.VOCAB_SIZE, hidden_size=tiny_gguf.HIDDEN_SIZE,
                         intermediate_size=tiny_gguf.INTERMEDIATE_SIZE, num_hidden_layers=tiny_gguf.NUM_LAYERS,
                         num_attention_heads=tiny_gguf.NUM_HEADS, num_key_value_heads=tiny_gguf.NUM_KV_HEADS,
                         rms_norm_eps=tiny_gguf.RMS_NORM_EPS, max_position_embeddings=tiny_gguf.CONTEXT_LENGTH,
                         tie_word_embeddings=True)
    hf = LlamaForCausalLM(config).eval()
    weights = dict(load_model_source(str(path), with_tokenizer=False).iter_weights())
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # the head is the tied embedding
    hf.tie_weights()
    return path, hf


@pytest.mark.parametrize("checkpoint, fmt, ordered", [(_gptq_act_order, "int4", True), (_awq, "int4", False),
                                                       (_compressed_w4a16, "int4", False),
                                                       (_gguf_q6_k, "int8", False)])
def test_packed_checkpoints_on_the_triton_products_give_hf_greedy_tokens(base, tmp_path, checkpoint, fmt, ordered):
    path, hf = checkpoint(base, tmp_path)
    llm = LLM(str(path), **ENGINE)
    model = llm.llm_engine.model
    products = [m.kernel.native for m in model.modules() if isinstance(m, _ShardedLinear)]
    assert products and all(isinstance(p, TritonQuantizedProduct) and p.format == fmt for p in products)
    assert all((p.input_order is not None) == ordered for p in products)
    if checkpoint is _gguf_q6_k:
        assert isinstance(model.embed_quantized, TritonQuantizedProduct)  # the tied table, kept packed
    # a prefill of 47 rows (the many-row tiling) and one decode step of 2 rows (the few-row tiling, its K loop
    # split): each decode step of the GGUF model, four times as wide, costs seconds in the interpreter
    assert_greedy_matches_hf(llm, hf, prompts=PROMPTS, count=2)
