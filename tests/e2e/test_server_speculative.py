"""`tokenmill serve` with speculative decoding: the same answers as without it, and its metrics."""

from __future__ import annotations

import pytest
from openai import OpenAI

from e2e.server_harness import ServerProcess, metric, metric_samples
from helpers.tiny_models import make_tiny_hf_model

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model = str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model"))
    logs = tmp_path_factory.mktemp("server-logs")
    common = ("--max-model-len", "256", "--num-kv-blocks", "256")
    plain = ServerProcess(model, *common, log_path=logs / "plain.log")
    # the tiny model drafts for itself, so most proposals are accepted and some steps emit several tokens
    speculative = ServerProcess(model, *common, "--speculative-method", "draft", "--draft-model", model,
                                "--num-speculative-tokens", "3", "--speculative-min-acceptance", "0",
                                log_path=logs / "speculative.log")
    try:
        plain.start()
        speculative.start()
        yield model, plain.wait_ready().url, speculative.wait_ready().url
    finally:
        for server in (plain, speculative):
            server.terminate()
        for server in (plain, speculative):
            server.stop()


def complete(url: str, model: str, **extra):
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}, **extra)


def test_speculative_server_answers_as_the_plain_one_and_counts_its_proposals(servers):
    model, plain_url, spec_url = servers
    before = metric_samples(spec_url)
    expected = complete(plain_url, model, logprobs=2)
    answer = complete(spec_url, model, logprobs=2)
    after = metric_samples(spec_url)

    assert answer.choices[0].text == expected.choices[0].text
    assert answer.choices[0].logprobs.tokens == expected.choices[0].logprobs.tokens
    assert len(answer.choices[0].logprobs.top_logprobs) == 24
    assert answer.choices[0].logprobs.token_logprobs == pytest.approx(expected.choices[0].logprobs.token_logprobs,
                                                                      abs=1e-4)
    assert answer.usage.completion_tokens == 24

    def grew(name: str) -> float:
        return metric(after, name) - metric(before, name)

    rounds, proposed = grew("tokenmill:spec_decode_num_drafts_total"), grew("tokenmill:spec_decode_num_draft_tokens_total")
    accepted = grew("tokenmill:spec_decode_num_accepted_tokens_total")
    assert rounds > 0 and 0 < accepted <= proposed <= 3 * rounds
    assert grew("tokenmill:spec_decode_num_emitted_tokens_total") == accepted + rounds
    assert grew("tokenmill:generation_tokens_total") == 24
    assert 0 < metric(after, "tokenmill:spec_decode_draft_acceptance_rate") <= 1
    assert 1 < metric(after, "tokenmill:spec_decode_mean_acceptance_length") <= 4


def test_speculative_streaming_and_sampling(servers):
    model, plain_url, spec_url = servers
    client = OpenAI(base_url=f"{spec_url}/v1", api_key="none", max_retries=0)
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert streamed == complete(plain_url, model).choices[0].text

    def sampled():
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=5, n=2,
                                         extra_body={"ignore_eos": True})

    first, second = sampled(), sampled()
    assert [c.text for c in first.choices] == [c.text for c in second.choices]  # seeded: reproducible
    assert all(c.finish_reason == "length" for c in first.choices)
