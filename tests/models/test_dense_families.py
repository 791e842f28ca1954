"""Dense model families of issue 60, each a tiny random checkpoint read from its own config.json as transformers
reads it: HF transformers float32's greedy ids and logprobs in every mode the engine schedules (helpers/
family_check.py), and a request's output in the default dtype of this CPU not depending on what else runs.

Cost: each family's check_family is two engine runs of 8 prompts x 32 tokens on a 2-layer (Gemma 2: 4-layer)
model, about 4 s; its batch-invariance scenario two small engines, about 3 s.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from helpers.engine_probe import EIGHT_PROMPTS
from helpers.family_check import check_alone_equals_batched, check_family
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.models.loader.hf_config import arch_config_from_hf

# Phi-4-mini's shape: RoPE on 12 of each head's 16 dims, tied embeddings, and a LongRoPE context stretched 128x
# past an original 8 positions, so every sequence of the check (the eight prompts, the shorter ones lengthened
# past 8 tokens) runs on the long factors in HF and in the engine (whose tables take them for any max_model_len
# past 8: layers/rotary.py)
PHI4_MINI = {"partial_rotary_factor": 0.75, "tie_word_embeddings": True, "original_max_position_embeddings": 8,
             "rope_scaling": {"type": "longrope", "short_factor": [1.0 + i / 4 for i in range(6)],
                              "long_factor": [3.0 + 2 * i for i in range(6)]}}
LONGER_THAN_8 = [ids if len(ids) > 8 else ids + list(range(20, 27)) for ids in EIGHT_PROMPTS]

# family -> (tiny_models arch, the class its config.json declares, config overrides, check_family options):
# what each family needs beyond Llama, set (in tiny_models' entry or here) so that it matters
DENSE_FAMILIES: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    # score soft-capping on every layer, alternating sliding layers, query_pre_attn_scalar, (1 + w) norms
    "gemma2": ("gemma2", "Gemma2ForCausalLM", {}, {}),
    # a layer without rotary embeddings (NoPE)
    "smollm3": ("smollm3", "SmolLM3ForCausalLM", {}, {}),
    # norms after the blocks only, q/k norms over whole projections; OLMo 3 sliding layers with their own RoPE
    "olmo2": ("olmo2", "Olmo2ForCausalLM", {}, {}),
    "olmo3": ("olmo3", "Olmo3ForCausalLM", {}, {}),
    # fused checkpoint tensors, LongRoPE's short factors; Phi-4-mini's partial rotary and long factors
    "phi3": ("phi3", "Phi3ForCausalLM", {}, {}),
    "phi4_mini": ("phi3", "Phi3ForCausalLM", PHI4_MINI, {"prompts": LONGER_THAN_8}),
}


@pytest.fixture(scope="module", params=sorted(DENSE_FAMILIES))
def dense_family(request, tmp_path_factory) -> tuple[str, Any, Any]:
    """(family, checkpoint folder, HF float32 model) of one family, shared by its tests."""
    from transformers import AutoModelForCausalLM

    arch, _, overrides, _ = DENSE_FAMILIES[request.param]
    path = make_tiny_hf_model(tmp_path_factory.mktemp(request.param), arch=arch, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return request.param, path, hf


def test_dense_family_equals_hf(dense_family):
    name, path, hf = dense_family
    # read as its own architecture (a family mapped onto another would fail check_family anyway, but less clearly)
    assert arch_config_from_hf(path).architecture == DENSE_FAMILIES[name][1] == hf.config.architectures[0]
    check_family(path, hf, **DENSE_FAMILIES[name][3])


def test_dense_family_output_does_not_depend_on_the_batch(dense_family):
    _, path, _ = dense_family
    check_alone_equals_batched(path)


def test_gemma2_soft_capped_attention_equals_hf_on_the_reference_and_triton_backends(tmp_path):
    # the backends check_family's CPU default does not run: torch_ref (capped scores outside SDPA) and
    # triton_paged in Triton's interpreter, which runs every kernel program in Python: 3 prompts x 4 tokens, one
    # past the window of 16, prefilled in 16-token chunks beside the others' decodes, then a prefix-cache hit
    from transformers import AutoModelForCausalLM

    from helpers.engine_probe import assert_sample_matches_hf

    path = make_tiny_hf_model(tmp_path, arch="gemma2", num_hidden_layers=2)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = [list(range(300, 100, -9)), [2, 3], [7, 8, 9] * 4]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    for backend in ("torch_ref", "triton_paged"):
        llm = LLM(str(path), attention_backend=backend, dtype="float32", linear_kernel="dense", block_size=8,
                  num_kv_blocks=64, max_model_len=64, max_num_batched_tokens=16)
        for round_ in range(2):  # the second: the first prompt's blocks cached
            batch = prompts if round_ == 0 else prompts[:1]
            outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
            for ids, output in zip(batch, outputs):
                assert_sample_matches_hf(hf, ids, output.outputs[0], mode=backend)
        assert llm.llm_engine.stats().prefix_cache_hits > 0
        llm.shutdown()


@pytest.mark.parametrize("architecture,setting,named", [
    ("Gemma2ForCausalLM", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("SmolLM3ForCausalLM", {"mlp_bias": True}, "mlp_bias"),
    ("SmolLM3ForCausalLM", {"no_rope_layers": [1]}, "no_rope_layers"),
    ("Olmo2ForCausalLM", {"clip_qkv": 8.0}, "clip_qkv"),
    ("Olmo3ForCausalLM", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                                              "full_attention": {"rope_type": "default"}}}, "sliding layers"),
    ("Phi3ForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
    ("Phi3ForCausalLM", {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8}}, "long_factor"),
])
def test_dense_family_settings_it_cannot_run_are_refused_by_name(tmp_path, architecture, setting, named):
    config = {"architectures": [architecture], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, **setting}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=named):
        arch_config_from_hf(tmp_path)
