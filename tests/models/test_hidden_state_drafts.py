"""EAGLE-3 heads and DeepSeek-V3's multi-token prediction layer as speculative drafts: greedy output identical to no
speculation, batched, chunked and preempted; and the refusals of drafts that do not fit the target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams

PROMPTS = ["Hello there, how", "one two three four five", "The capital of France is", "def f(x):\n    return",
           "a b c d e f", "Why is the sky", "1 2 3 4", "Tell me a story about a dragon who"]
# 8 prompts x 24 tokens (the bar is 64, at about 3x the cost): each token costs a verification round of the
# tiny target and k draft passes, and 24 already spans preemption, chunked prefills beside verifications and many
# rounds per request
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
BLOCK = 16
# a pool of 5 blocks cannot hold the eight requests at once (some are preempted and recomputed); 12-token
# budgets chunk the prompts, so prefill chunks run beside other requests' verifications
STRESSED = dict(dtype="float32", quantization="none", block_size=BLOCK, num_kv_blocks=5, max_num_batched_tokens=12,
                max_model_len=48, speculative_max_batch=8, speculative_min_acceptance=0.0)


def write_eagle3_head(folder: Path, hidden: int = 64, vocab: int = 49152, draft_vocab: int = 512,
                      **config: object) -> Path:
    """A random-weight EAGLE-3 head as such checkpoints are stored (midlayer.*, fc, norm, lm_head over a draft
    vocabulary of `draft_vocab` tokens, d2t/t2d), reading the target's layers 1, 2 and 3."""
    heads, kv_heads, width = 4, 2, 128
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": width, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": draft_vocab, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0,
        "bos_token_id": 1, "eos_token_id": 2, "eagle_aux_hidden_state_layer_ids": [1, 2, 3], **config}))
    generator = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=generator) * 0.1  # noqa: E731
    head_dim = hidden // heads
    tensors = {f"midlayer.{name}.weight": torch.ones(hidden)
               for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
    tensors.update({"midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
                    "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
                    "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
                    "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
                    "midlayer.mlp.gate_proj.weight": rand(width, hidden), "midlayer.mlp.up_proj.weight": rand(width, hidden),
                    "midlayer.mlp.down_proj.weight": rand(hidden, width), "fc.weight": rand(hidden, 3 * hidden),
                    "norm.weight": torch.ones(hidden), "lm_head.weight": rand(draft_vocab, hidden)})
    kept = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
    tensors["d2t"] = kept - torch.arange(draft_vocab)
    tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, kept, True)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def llama_target(tmp_path_factory) -> Path:
    # 4 layers: the head reads three distinct ones (1, 2, 3)
    return make_tiny_hf_model(tmp_path_factory.mktemp("llama"), num_hidden_layers=4)


@pytest.fixture(scope="module")
def eagle3_head(tmp_path_factory) -> Path:
    return write_eagle3_head(tmp_path_factory.mktemp("eagle3"))


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory) -> Path:
    # its MTP layer (model.layers.2.*) is written beside transformers' save by make_tiny_hf_model
    return make_tiny_hf_model(tmp_path_factory.mktemp("dsv3"), arch="deepseek_v3")


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def check_identical_with_drafts(path: Path, speculative_config: dict) -> None:
    plain = greedy(LLM(str(path), dtype="float32", quantization="none"))
    llm = LLM(str(path), **STRESSED, speculative_config=speculative_config)
    assert greedy(llm) == plain
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions > 0 and stats.spec.num_rounds > 0
    assert stats.spec.draft_tokens > stats.spec.num_rounds  # rounds of several proposals (chained passes)
    proposer = llm.llm_engine.speculation.proposer
    assert proposer.kv.pool.num_used_blocks == 0  # every finished request freed its draft KV
    assert not proposer.hidden._held  # and its held hidden states


def test_eagle3_head_keeps_greedy_output_identical(llama_target, eagle3_head):
    check_identical_with_drafts(llama_target, {"method": "eagle3", "model": str(eagle3_head),
                                               "num_speculative_tokens": 2})


def test_deepseek_v3_mtp_layer_keeps_greedy_output_identical(deepseek_v3):
    check_identical_with_drafts(deepseek_v3, {"method": "mtp", "num_speculative_tokens": 2})


def test_drafts_that_do_not_fit_the_target_are_refused(llama_target, eagle3_head, tmp_path):
    engine = dict(dtype="float32", quantization="none")
    with pytest.raises(ValueError, match="'mtp' runs the multi-token prediction layers of DeepseekV3ForCausalLM"):
        LLM(str(llama_target), **engine, speculative_config={"method": "mtp"})
    small_vocab = write_eagle3_head(tmp_path / "small", vocab=1000, draft_vocab=100)
    with pytest.raises(ValueError, match="vocab_size 1000 is not the target's 49152"):
        LLM(str(llama_target), **engine, speculative_config={"method": "eagle3", "model": str(small_vocab)})
    default_layers = write_eagle3_head(tmp_path / "default", eagle_aux_hidden_state_layer_ids=None)
    with pytest.raises(ValueError, match=r"three distinct layers of the target's 4; the layer ids \[2, 2, 1\]"):
        LLM(str(llama_target), **engine, speculative_config={"method": "eagle3", "model": str(default_layers)})
    with pytest.raises(ValueError, match="architectures"):
        LLM(str(llama_target), **engine, speculative_config={"method": "eagle3", "model": str(llama_target)})
