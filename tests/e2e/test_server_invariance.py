"""Through the OpenAI API, on the default model in its default configuration: a request's tokens and
logprobs are the same streamed or not, with n = 2, among concurrent requests, and the hundredth time."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from e2e.server_harness import ServerProcess

MESSAGES = [{"role": "user", "content": "Give me three tips for writing clear code."}]
OTHER_MESSAGES = [[{"role": "user", "content": text}] for text in
                  ("Hi!", "Write a limerick about a cat who codes.", "What is 12 squared?",
                   "Summarise the plot of Hamlet in two sentences.", "Name five rivers in Europe.")]
REQUEST = dict(model="smollm2-135m-instruct", messages=MESSAGES, max_tokens=12, logprobs=True, top_logprobs=2,
               extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    server = ServerProcess(None, "--max-model-len", "1024", "--max-num-batched-tokens", "32",
                           "--num-kv-blocks", "512", log_path=tmp_path_factory.mktemp("logs") / "server.log").start()
    try:
        server.wait_ready()
        yield OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        server.terminate()
        server.stop()


def tokens_and_logprobs(content) -> list:
    return [(t.token, t.logprob, [(top.token, top.logprob) for top in t.top_logprobs]) for t in content]


def whole(client, **changes) -> list:
    response = client.chat.completions.create(**{**REQUEST, **changes})
    return [tokens_and_logprobs(choice.logprobs.content) for choice in response.choices]


def streamed(client, **changes) -> list:
    content = []
    for chunk in client.chat.completions.create(**{**REQUEST, **changes}, stream=True):
        for choice in chunk.choices:
            if choice.logprobs and choice.logprobs.content:
                content.extend(choice.logprobs.content)
    return [tokens_and_logprobs(content)]


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, seed=77)])
def test_same_answer_streamed_with_n2_and_among_others(client, sampling):
    alone = whole(client, **sampling)
    assert len(alone[0]) == 12
    assert streamed(client, **sampling) == alone
    with ThreadPoolExecutor(len(OTHER_MESSAGES) + 1) as pool:
        others = [pool.submit(client.chat.completions.create, **{**REQUEST, "messages": m, "max_tokens": 20})
                  for m in OTHER_MESSAGES]
        among = pool.submit(whole, client, **sampling)
        assert among.result() == alone
        assert all(o.result().choices for o in others)
    if "seed" not in sampling:  # greedy: every choice of n = 2 is the same answer
        assert whole(client, n=2, **sampling) == alone * 2
    assert [whole(client, **sampling) for _ in range(3)] == [alone] * 3
