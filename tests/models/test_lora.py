"""Multi-LoRA against PEFT over HF transformers (float32, the oracle): three random adapters of different
ranks and targets mixed in one batch with base-model requests; adapters loaded, unloaded and refused."""

from __future__ import annotations

import pytest
import torch

from helpers.engine_probe import EIGHT_PROMPTS, hf_greedy_tokens
from helpers.tiny_models import make_random_lora, make_tiny_hf_model
from tokenmill import LLM, LoRARequest, SamplingParams

ADAPTERS = {  # name -> (rank, targets)
    "attn-qv": (4, ["q_proj", "v_proj"]),
    "everything": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mlp-out": (2, ["o_proj", "down_proj"]),
}
TOKENS = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_hf_model(root / "base")
    adapters = {name: make_random_lora(base, root / name, rank, targets, seed)
                for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items())}
    return base, adapters


@pytest.fixture(scope="module")
def oracle(folders):
    """Greedy tokens of each adapter (and the base, None) under PEFT, for the first prompts."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, adapters = folders
    expected = {}
    for name in [None, *adapters]:
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
        if name is not None:
            model = PeftModel.from_pretrained(model, str(adapters[name])).eval()
        expected[name] = [hf_greedy_tokens(model, ids, TOKENS) for ids in EIGHT_PROMPTS[:4]]
    return expected


def _requests(adapters):
    return {name: LoRARequest(name, index + 1, str(path)) for index, (name, path) in enumerate(adapters.items())}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_batch_matches_peft(folders, oracle, async_scheduling):
    base, adapters = folders
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=8, num_kv_blocks=256,
              async_scheduling=async_scheduling)
    requests = _requests(adapters)
    plan = [(name, ids) for ids_index, ids in enumerate(EIGHT_PROMPTS[:4]) for name in [None, *adapters]]
    outputs = llm.generate([ids for _, ids in plan], SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True),
                           use_tqdm=False, lora_request=[requests.get(name) for name, _ in plan])
    for (name, ids), output in zip(plan, outputs):
        assert output.outputs[0].token_ids == oracle[name][EIGHT_PROMPTS.index(ids)], name
    for name in adapters:  # each adapter changes what the model says
        assert oracle[name] != oracle[None]


def test_default_dtype_output_does_not_depend_on_the_batch(folders):
    """bfloat16 where the CPU has it: an adapter's request gives the same ids and logprobs alone as mixed
    with other adapters' and base requests (the grouped products are batch-invariant)."""
    base, adapters = folders
    llm = LLM(str(base), enable_lora=True, max_loras=3, max_lora_rank=8, num_kv_blocks=256)
    requests = _requests(adapters)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    alone = llm.generate(EIGHT_PROMPTS[1], params, use_tqdm=False, lora_request=requests["everything"])[0]
    names = [None, "attn-qv", "everything", "mlp-out"] * 2
    mixed = llm.generate([EIGHT_PROMPTS[i % 8] if n != "everything" else EIGHT_PROMPTS[1] for i, n in enumerate(names)],
                         params, use_tqdm=False, lora_request=[requests.get(n) for n in names])
    for name, output in zip(names, mixed):
        if name == "everything":
            assert output.outputs[0].token_ids == alone.outputs[0].token_ids
            assert [e[t].logprob for e, t in zip(output.outputs[0].logprobs, output.outputs[0].token_ids)] == \
                [e[t].logprob for e, t in zip(alone.outputs[0].logprobs, alone.outputs[0].token_ids)]


def test_prefix_cache_keeps_adapters_apart(folders, oracle):
    """The same prompt under the base model and under an adapter shares no cached block (the keys carry
    the adapter), and a second request of one adapter does hit its own blocks."""
    base, adapters = folders
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=256)
    adapter = _requests(adapters)["everything"]
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    prompt = EIGHT_PROMPTS[1]
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    adapted = llm.generate(prompt, params, use_tqdm=False, lora_request=adapter)[0]
    again = llm.generate(prompt, params, use_tqdm=False, lora_request=adapter)[0]
    assert adapted.metrics.num_cached_tokens == 0 and again.metrics.num_cached_tokens > 0
    assert first.outputs[0].token_ids == oracle[None][1]
    assert adapted.outputs[0].token_ids == again.outputs[0].token_ids == oracle["everything"][1]


def test_adapters_are_checked_and_unloaded(folders, tmp_path):
    base, adapters = folders
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=4, num_kv_blocks=64)
    registry = llm.llm_engine.loras
    with pytest.raises(ValueError, match="rank 8 is above --max-lora-rank 4"):
        registry.add("big", str(adapters["everything"]))
    with pytest.raises(ValueError, match="adapter_config.json not found"):
        registry.add("nowhere", str(tmp_path))
    registry.add("qv", str(adapters["attn-qv"]))
    with pytest.raises(ValueError, match="already loaded"):
        registry.add("qv", str(adapters["mlp-out"]))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([1, 2, 3], params, use_tqdm=False, lora_request=LoRARequest("qv", 1, str(adapters["attn-qv"])))
    model_lora = llm.llm_engine.model.lora
    assert model_lora.loaded == {registry.adapters["qv"].lora_int_id}
    registry.remove("qv")
    llm.generate([1, 2, 3], params, use_tqdm=False)  # the next step carries the unload
    assert model_lora.loaded == set()
    plain = LLM(str(base), dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate([1, 2, 3], params, lora_request=LoRARequest("qv", 1, str(adapters["attn-qv"])))
