"""Executors: a worker process gives what the in-process runner gives, and a dead worker is an error, not a hang."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from helpers.tiny_models import make_tiny_hf_model
from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError
from tokenmill.engine.llm import LLM
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.executor import ExecutorDiedError
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.spec import StructuredOutput

PROMPTS = [[1, 5, 9, 13, 2, 7, 5, 9, 13], [3, 3, 8], list(range(20, 57))]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama"))


def results(llm: LLM, params: list[SamplingParams]):
    outputs = llm.generate([p for p in PROMPTS for _ in params], params * len(PROMPTS), use_tqdm=False)
    return [(o.prompt_logprobs, [(s.token_ids, s.logprobs, s.finish_reason) for s in o.outputs]) for o in outputs]


def test_a_worker_process_gives_the_in_process_tokens_and_logprobs(tiny_llama):
    params = [SamplingParams(max_tokens=12, temperature=0.0, logprobs=3),
              SamplingParams(max_tokens=12, temperature=0.9, seed=7, logprobs=1, n=2),
              SamplingParams(max_tokens=8, temperature=0.0,
                             structured_output=StructuredOutput.choice(["yes", "no", "maybe"])),
              SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=2, repetition_penalty=1.3)]
    options = dict(num_kv_blocks=24, block_size=4, max_num_batched_tokens=16,  # chunks and preemption
                   speculative_method="ngram", num_speculative_tokens=3)
    here = LLM(tiny_llama, **options)
    there = LLM(tiny_llama, distributed_executor_backend="mp", **options)
    try:
        assert "1 worker process" in there.llm_engine.executor.description
        assert results(there, params) == results(here, params)
    finally:
        there.shutdown()
    assert not any(p.is_alive() for p in there.llm_engine.executor.processes)


def test_a_killed_worker_fails_the_next_step_naming_the_rank(tiny_llama):
    engine = LLMEngine(EngineConfig.from_kwargs(model=tiny_llama, num_kv_blocks=32,
                                                distributed_executor_backend="mp"))
    try:
        os.kill(engine.executor.processes[0].pid, signal.SIGKILL)
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
        with pytest.raises(ExecutorDiedError, match="worker rank 0"):
            engine.step()
        assert "worker rank 0" in engine.executor.failure()
    finally:
        engine.shutdown()


def test_with_no_replacement_allowed_a_dead_worker_fails_in_flight_requests_and_the_engine(tiny_llama):
    """--max-worker-restarts 0: the engine does not replace the group (tests/e2e/test_server_parallel.py has the
    replacement), so the requests in flight fail and the engine dies at once."""
    deaths = []
    engine = AsyncEngine(lambda: LLMEngine(EngineConfig.from_kwargs(
        model=tiny_llama, num_kv_blocks=64, distributed_executor_backend="mp", max_worker_restarts=0)), "tiny",
        on_dead=deaths.append)

    async def generate_until_killed():
        params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True, output_kind="delta")
        killed = None
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("long", [1, 2, 3], params):
                if killed is None:
                    os.kill(engine.engine.executor.processes[0].pid, signal.SIGKILL)
                    killed = time.monotonic()
        return time.monotonic() - killed

    try:
        seconds = asyncio.run(generate_until_killed())
        deadline = time.monotonic() + 5
        while not deaths and time.monotonic() < deadline:  # on_dead runs just after the streams are failed
            time.sleep(0.05)
        assert seconds < 5 and engine.dead and "worker rank 0" in deaths[0] and "not replacing it" in deaths[0]
    finally:
        engine.shutdown()


def test_parallel_sizes_the_executor_cannot_run_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 is more than the model's 2 layers"):
        LLM(tiny_llama, pipeline_parallel_size=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide the model's attention heads \(4\)"):
        LLM(tiny_llama, tensor_parallel_size=3)


def test_collective_rpc_and_sleep_reach_every_tensor_parallel_rank(tiny_llama):
    """Control calls between steps reach each rank's worker process: collective_rpc answers in rank order; a method
    the extension class lacks is refused with its message and the ranks serve on; sleep level 1 gives back every
    rank's KV pool, level 2 every rank's weights too, and after each wake_up the same greedy tokens come (each rank
    reloads its own shard)."""
    llm = LLM(tiny_llama, tensor_parallel_size=2, num_kv_blocks=64,
              worker_extension_cls="helpers.worker_extensions:Inspector")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    try:
        before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        layers = llm.llm_engine.arch.num_hidden_layers
        assert llm.collective_rpc("num_layers") == [layers, layers]
        with pytest.raises(ValueError, match="'_private' is not a method of the worker extension class"):
            llm.collective_rpc("_private")
        released = llm.sleep(level=1)["kv_pool_bytes_released"]
        engine = llm.llm_engine
        arch, kv = engine.arch, engine.kv_cache  # each rank's pool: K and V of its half of the KV heads, float32
        per_rank = kv.num_blocks * kv.block_size * arch.num_hidden_layers * 2 * (arch.num_key_value_heads // 2) * \
            arch.head_dim * 4
        assert released == 2 * per_rank
        llm.wake_up()
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == before
        llm.sleep(level=2)
        llm.wake_up()
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == before
    finally:
        llm.shutdown()
