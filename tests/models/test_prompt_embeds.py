"""Prompts given as input embeddings (enable_prompt_embeds, vLLM's prompt_embeds): the embedding table's rows of a
prompt's tokens give exactly the outputs of the tokens themselves (ids and logprobs, float32), alone and batched
with token prompts; the prefix cache finds the same embeddings again and never other ones; the server takes them
as base64 of torch.save, loaded with weights_only (a pickled object is refused), and answers bad ones with a 400
naming prompt_embeds. Cost: a tiny checkpoint written without transformers, three engines of ~0.3 s."""

from __future__ import annotations

import base64
import io
import pickle

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file

from helpers.agreeing_drafts import write_bigram_llama
from tokenmill import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [900, 901, 902, 903, 904, 905, 906]]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
ENGINE = dict(dtype="float32", quantization="none", num_kv_blocks=64, block_size=4)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = write_bigram_llama(tmp_path_factory.mktemp("embeds") / "llama")
    table = load_file(str(folder / "model.safetensors"))["model.embed_tokens.weight"]
    return str(folder), table


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model[0], enable_prompt_embeds=True, **ENGINE)


def _outputs(outputs) -> list:
    return [(tuple(o.outputs[0].token_ids), [sorted((t, lp.logprob) for t, lp in step.items())
                                             for step in o.outputs[0].logprobs]) for o in outputs]


def test_embeddings_of_a_prompts_tokens_give_the_tokens_outputs_alone_and_batched(model, llm):
    _, table = model
    by_ids = _outputs(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False))
    llm.reset_prefix_cache()
    alone = _outputs(llm.generate([{"prompt_embeds": table[PROMPTS[0]]}], PARAMS, use_tqdm=False))
    llm.reset_prefix_cache()
    mixed = _outputs(llm.generate([{"prompt_embeds": table[PROMPTS[0]].unsqueeze(0)},
                                   {"prompt_token_ids": PROMPTS[1]}], PARAMS, use_tqdm=False))
    assert alone == by_ids[:1] and mixed == by_ids
    # the same embeddings hit the prefix cache; other embeddings of the same length never share its blocks
    hits = llm.llm_engine.stats().prefix_cache_hits
    llm.generate([{"prompt_embeds": table[PROMPTS[0]]}], PARAMS, use_tqdm=False)
    assert llm.llm_engine.stats().prefix_cache_hits > hits
    hits = llm.llm_engine.stats().prefix_cache_hits
    other = _outputs(llm.generate([{"prompt_embeds": table[PROMPTS[0]] * 1.5}], PARAMS, use_tqdm=False))
    assert llm.llm_engine.stats().prefix_cache_hits == hits and other != alone


def test_bad_embeddings_and_an_engine_without_the_flag_are_refused_naming_the_problem(model, llm):
    _, table = model
    for embeds, problem in ((table[:4, :-1], r"shape \[tokens, 64\]"), (table[:0], "at least one token"),
                            (table[:4].to(torch.int32), "must be float32"),
                            (torch.full((3, 64), float("nan")), "not finite"), ([[0.0] * 64], "must be a tensor")):
        with pytest.raises(ValueError, match=problem):
            llm.generate([{"prompt_embeds": embeds}], PARAMS, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs: a prompt given as embeddings"):
        llm.generate([{"prompt_embeds": table[:4]}], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
    with pytest.raises(ValueError, match="start it with enable_prompt_embeds"):
        LLM(model[0], **ENGINE).generate([{"prompt_embeds": table[:4]}], PARAMS, use_tqdm=False)
    with pytest.raises(ValueError, match="given as embeddings and speculative decoding do not combine"):
        LLM(model[0], enable_prompt_embeds=True, speculative_method="ngram", **ENGINE)


def _encoded(value) -> str:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def test_the_completions_api_takes_base64_embeddings_and_answers_bad_ones_400(model):
    from tokenmill.config import EngineConfig, ServerConfig
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.server.api_server import build_app

    path, table = model
    engine = AsyncEngine(lambda: LLMEngine(EngineConfig.from_kwargs(model=path, enable_prompt_embeds=True,
                                                                    **ENGINE)), "m")
    client = TestClient(build_app(engine, ServerConfig(), None))
    try:
        def complete(**body):
            return client.post("/v1/completions", json={"model": "m", "max_tokens": 5, "temperature": 0,
                                                        "logprobs": 1, **body})

        by_ids = complete(prompt=PROMPTS[0]).json()
        by_embeds = complete(prompt_embeds=_encoded(table[PROMPTS[0]])).json()
        assert [c["text"] for c in by_embeds["choices"]] == [c["text"] for c in by_ids["choices"]]
        assert by_embeds["choices"][0]["logprobs"] == by_ids["choices"][0]["logprobs"]
        assert by_embeds["usage"]["prompt_tokens"] == len(PROMPTS[0])
        both = complete(prompt_embeds=[_encoded(table[PROMPTS[1]])], prompt=PROMPTS[0]).json()["choices"]
        assert both[1]["text"] == by_ids["choices"][0]["text"]  # embeds first, then the prompts (vLLM's order)

        class Payload:
            def __reduce__(self):
                return (print, ("unpickled",))

        for body, problem in (({"prompt_embeds": "not base64!"}, "not valid base64"),
                              ({"prompt_embeds": base64.b64encode(pickle.dumps(Payload(), protocol=2)).decode()},
                               "not a tensor saved with torch.save"),
                              ({"prompt_embeds": _encoded({"x": table[:2].clone()})}, "holds a dict"),
                              ({"prompt_embeds": _encoded(table[:3, :10].clone())}, "shape"),
                              ({"prompt_embeds": _encoded(table[:3].clone()), "echo": True}, "echo"), ({}, "required")):
            response = complete(**body)
            assert response.status_code == 400 and problem in response.json()["error"]["message"], body
        assert complete(prompt=PROMPTS[1]).status_code == 200  # and it serves on
    finally:
        engine.shutdown()
