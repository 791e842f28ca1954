"""A failure that belongs to one request ends that request only; a fault of the engine itself fails the
requests in flight and then the engine recovers (or is declared dead). In-process, on a tiny model."""

from __future__ import annotations

import asyncio
import time

import pytest

from helpers.tiny_models import SMOLLM2_VOCAB_SIZE, make_tiny_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.admission import AdmissionLimits
from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestFailedError
from tokenmill.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [100, 200, 300], [42] * 20]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama"))


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, dtype="float32", block_size=8, num_kv_blocks=128)


def run_all(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], sabotage=None):
    """Run the requests to the end; `sabotage(params)` then breaks the first one's parameters behind the
    engine's back (after its validation), as a validation gap would."""
    for request_id, (ids, params) in requests.items():
        engine.add_request(request_id, None, params, prompt_token_ids=ids)
    if sabotage is not None:
        sabotage(next(iter(requests.values()))[1])
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
    return final


def sampling_poison(params: SamplingParams) -> None:
    params.logit_bias = {SMOLLM2_VOCAB_SIZE + 5: 1.0}  # an index the logits do not have


def output_poison(params: SamplingParams) -> None:
    params.stop_strings = [None]  # the output processor's stop-string search raises on it


def sampled() -> SamplingParams:
    return SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=7)


@pytest.mark.parametrize("poison", [sampling_poison, output_poison])
def test_a_failing_request_ends_alone_and_the_rest_are_token_identical(llm, poison):
    engine = llm.llm_engine
    solo = run_all(engine, {f"solo{i}": (ids, GREEDY) for i, ids in enumerate(PROMPTS)})
    mixed = run_all(engine, {"poison": (PROMPTS[0], sampled()),
                             **{f"mixed{i}": (ids, GREEDY) for i, ids in enumerate(PROMPTS)}}, poison)
    assert mixed["poison"].error and mixed["poison"].outputs[0].finish_reason == "error"
    for i in range(len(PROMPTS)):
        assert mixed[f"mixed{i}"].error is None
        assert mixed[f"mixed{i}"].outputs[0].token_ids == solo[f"solo{i}"].outputs[0].token_ids
    assert engine.kv_cache.pool.num_used_blocks == 0 and not engine.scheduler.requests


def test_a_failing_sample_of_n_fails_its_whole_request(llm):
    engine = llm.llm_engine
    params = sampled()
    params.n = 3
    final = run_all(engine, {"fanned": (PROMPTS[1], params), "fine": (PROMPTS[2], GREEDY)}, output_poison)
    assert [c.finish_reason for c in final["fanned"].outputs] == ["error"] * 3
    assert final["fine"].error is None and len(final["fine"].outputs[0].token_ids) == 12
    assert engine.kv_cache.pool.num_used_blocks == 0 and not engine.scheduler.requests


def test_a_constraint_that_forbids_every_token_fails_only_its_request(llm):
    from tokenmill.structured.spec import StructuredOutput

    engine = llm.llm_engine
    def ban_everything(params: SamplingParams) -> None:
        params.logit_bias = {t: -float("inf") for t in range(SMOLLM2_VOCAB_SIZE)}

    params = SamplingParams(temperature=0.0, max_tokens=8, structured_output=StructuredOutput.choice(["yes"]))
    final = run_all(engine, {"banned": ([5, 6, 7], params), "fine": (PROMPTS[0], GREEDY)}, ban_everything)
    assert "no token is allowed" in final["banned"].error
    assert final["fine"].error is None


# ------------------------------------------------------------------------------------- async engine
def make_async(model_path: str, **limits) -> AsyncEngine:
    config = EngineConfig.from_kwargs(model=model_path, dtype="float32", block_size=8, num_kv_blocks=128,
                                      max_num_seqs=4)
    return AsyncEngine(lambda: LLMEngine(config), "tiny", AdmissionLimits(**limits))


async def collect(engine: AsyncEngine, request_id: str, ids: list[int], params: SamplingParams, sabotage=None):
    final = None
    async for output in engine.generate(request_id, ids, params):
        if sabotage is not None:
            sabotage(params)
            sabotage = None
        final = output
    return final


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_failed_request_raises_for_its_caller_only(model_path):
    engine = make_async(model_path)
    try:
        async def main():
            return await asyncio.gather(collect(engine, "bad", PROMPTS[0], sampled(), sampling_poison),
                                        collect(engine, "good", PROMPTS[1], GREEDY), return_exceptions=True)
        bad, good = asyncio.run(main())
        assert isinstance(bad, RequestFailedError) and "IndexError" in str(bad)
        assert good.outputs[0].finish_reason == "length" and engine.is_alive
    finally:
        engine.shutdown()


def test_an_engine_fault_fails_the_batch_then_the_engine_recovers(model_path):
    engine = make_async(model_path)
    try:
        runner = engine.engine.runner
        real_execute = runner.execute_async
        calls = {"n": 0}

        def fail_once(schedule):
            calls["n"] += 1
            if calls["n"] == 3:
                raise MemoryError("simulated: out of memory in the forward pass")
            return real_execute(schedule)
        runner.execute_async = fail_once

        async def main():
            return await asyncio.gather(*(collect(engine, f"r{i}", ids, GREEDY) for i, ids in enumerate(PROMPTS)),
                                        return_exceptions=True)
        results = asyncio.run(main())
        assert all(isinstance(r, EngineDeadError) and "MemoryError" in str(r) for r in results)
        wait_until(lambda: engine.is_alive)
        assert engine.engine.kv_cache.pool.num_used_blocks == 0
        after = asyncio.run(collect(engine, "after", PROMPTS[0], GREEDY))
        assert after.outputs[0].finish_reason == "length"
        assert engine.metrics.faults._value.get() == 1
    finally:
        engine.shutdown()


def test_an_engine_that_cannot_step_is_declared_dead(model_path):
    deaths = []
    config = EngineConfig.from_kwargs(model=model_path, dtype="float32", num_kv_blocks=64)
    engine = AsyncEngine(lambda: LLMEngine(config), "tiny", on_dead=deaths.append)
    try:
        def broken(schedule):
            raise RuntimeError("simulated kernel error")
        engine.engine.runner.execute_async = broken
        with pytest.raises(EngineDeadError):
            asyncio.run(collect(engine, "r", PROMPTS[0], GREEDY))
        wait_until(lambda: engine.dead)
        assert not engine.is_alive and "probe" in engine.fault and len(deaths) == 1
        with pytest.raises(EngineDeadError, match="stopped"):
            asyncio.run(collect(engine, "late", PROMPTS[0], GREEDY))
    finally:
        engine.shutdown()


def test_a_request_cancelled_during_admission_never_runs(model_path):
    engine = make_async(model_path)
    try:
        async def main():
            task = asyncio.ensure_future(collect(engine, "gone", PROMPTS[2],
                                                 SamplingParams(max_tokens=200, ignore_eos=True)))
            await asyncio.sleep(0)  # the add is queued for the engine thread, not yet admitted
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        asyncio.run(main())
        wait_until(lambda: engine.engine.get_num_unfinished_requests() == 0)
        assert engine.engine.kv_cache.pool.num_used_blocks == 0
    finally:
        engine.shutdown()


def test_the_waiting_queue_is_bounded(model_path):
    engine = make_async(model_path, max_waiting_requests=2)
    try:
        async def main():
            long = SamplingParams(max_tokens=40, ignore_eos=True)
            return await asyncio.gather(*(collect(engine, f"r{i}", PROMPTS[0], long) for i in range(12)),
                                        return_exceptions=True)
        results = asyncio.run(main())
        refused = [r for r in results if isinstance(r, QueueFullError)]
        done = [r for r in results if not isinstance(r, BaseException)]
        assert refused and done and len(refused) + len(done) == 12
        assert all(len(r.outputs[0].token_ids) == 40 for r in done)
    finally:
        engine.shutdown()
