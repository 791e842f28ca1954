"""A torch-free stand-in for the model runner: the next token is a pure function of the sequence so far."""

from __future__ import annotations

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler, SchedulingLimits
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

EOS = 2


def next_token(tokens: list[int]) -> int:
    """Deterministic 'model': depends on every token, never EOS unless the sequence says so."""
    return 10 + (sum(t * (i + 1) for i, t in enumerate(tokens)) % 997)


class FakeRunner:
    """Checks what a real runner relies on (token positions, block capacity) and samples next_token."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.sequences: dict[str, list[int]] = {}
        self.steps: list[SchedulerOutput] = []

    def execute(self, schedule: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(schedule)
        out = ModelRunnerOutput()
        for item in schedule.scheduled:
            if item.request_id not in self.sequences:  # a fork starts with its parent's shared blocks
                self.sequences[item.request_id] = item.prompt_token_ids[:item.start]
            seq = self.sequences[item.request_id]
            assert item.start <= len(seq), "a chunk must start where the cache ends (or earlier, on recompute)"
            del seq[item.start:]
            seq.extend(item.token_ids)
            capacity = len(item.block_ids) * self.kv.block_size
            assert capacity >= len(seq), "blocks must cover every computed token"
            assert seq == (item.prompt_token_ids + item.output_token_ids)[:len(seq)]
            if item.sample:
                out.sampled_token_ids[item.request_id] = next_token(seq)
        return out


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 32, max_seqs: int = 8,
                   max_model_len: int = 256, watermark: float = 0.0) -> tuple[Scheduler, FakeRunner]:
    kv = KVCacheManager(num_blocks, block_size, watermark=watermark)
    return Scheduler(SchedulingLimits(budget, max_seqs, max_model_len), kv), FakeRunner(kv)


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, priority: int = 0, n: int = 1,
                 seed_token: int = 5) -> Request:
    prompt = [(seed_token * 31 + i * 7) % 500 + 3 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, n=n), max_tokens, (EOS,), priority,
                   num_samples_to_fork=n - 1)


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        schedule = scheduler.schedule()
        for update in scheduler.update_from_output(schedule, runner.execute(schedule)):
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
        scheduler.kv_cache.pool.check_invariants()
    raise AssertionError("scheduler did not finish")
