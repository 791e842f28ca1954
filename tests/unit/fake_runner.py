"""A torch-free stand-in for the model runner: the next token is a pure function of the sequence so far."""

from __future__ import annotations

import pickle

import numpy as np

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.scheduling import SchedulingLimits
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.input_batch import InputBatch
from tokenmill.worker.request_state import PLACEHOLDER

EOS = 2


def next_token(tokens: list[int]) -> int:
    """Deterministic 'model': depends on every token, never EOS unless the sequence says so."""
    return 10 + (sum(t * (i + 1) for i, t in enumerate(tokens)) % 997)


class FakeRunner:
    """Checks what a real runner relies on (token positions, block capacity) and samples next_token.

    Like the real runner it knows requests only through the step contract's diffs (InputBatch), and
    checks them against the scheduler's own view: the pickled step must rebuild the same sequence.
    """

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.states = InputBatch(kv.block_size, kv.num_groups, max_num_seqs=2, max_model_len=8)  # grows
        self.steps: list[SchedulerOutput] = []
        self.items: list = []  # the batch items of the latest step
        self.requests = None  # the scheduler's requests, to compare with, when given
        self.block_contents: dict[int, dict[int, int]] = {}  # block -> offset -> token written there
        self.tier_contents: dict[int, dict[int, int]] = {}  # second-tier slot -> saved block contents
        self.sampled: dict[str, list[int]] = {}  # the previous step's sampled tokens: what placeholders stand for
        self.num_placeholders = 0

    def sequence(self, item) -> list[int]:
        """The item's tokens so far, its placeholder filled in as the real runner does: with the token the
        previous step sampled for it."""
        tokens = np.asarray(item.prompt_token_ids).tolist() + np.asarray(item.output_token_ids).tolist()
        if item.placeholder:
            assert item.token_ids == [PLACEHOLDER] and item.start == len(tokens)
            tokens = tokens + [self.sampled[item.request_id][-1]]
        return tokens

    def _check_reads_and_write(self, item, tokens: list[int]) -> None:
        """What attention would read must be what was written: no stale or foreign KV, ever. In each KV
        cache group, a query at position p reads the keys its group's window leaves it, (p - W, p] (its chunk:
        [(p // C) * C, p])."""
        bs = self.kv.block_size
        for group, table in enumerate(item.block_ids):
            first_read = self._first_read(group, item.start)
            for position in range(first_read, item.start):
                written = self.block_contents.get(table[position // bs], {}).get(position % bs)
                assert written == tokens[position], \
                    f"{item.request_id} reads stale KV at position {position} in group {group}"
            for position, token in enumerate(tokens[item.start:item.start + item.num_tokens - len(item.spec_token_ids)]
                                             + item.spec_token_ids, start=item.start):
                self.block_contents.setdefault(table[position // bs], {})[position % bs] = token

    def execute(self, schedule: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(schedule)
        schedule = pickle.loads(pickle.dumps(schedule))  # what a worker process would receive
        self.items = self.states.apply(schedule)
        for item in self.items:  # the runner's rebuilt state is the scheduler's
            assert [list(t) for t in item.block_ids] == self.kv.block_tables(item.request_id), \
                f"{item.request_id}: block table drifted"
            if self.requests is not None:
                request = self.requests[item.request_id]
                assert (list(item.prompt_token_ids), list(item.output_token_ids)) == \
                    (request.prompt_token_ids, request.output_token_ids), f"{item.request_id}: tokens drifted"
        out = ModelRunnerOutput()
        tier = schedule.copies("tier")
        for block, slot in tier.out if tier else ():  # saves first, then loads, then the forward pass
            self.tier_contents[slot] = dict(self.block_contents.get(block, {}))
        for slot, block in tier.into if tier else ():
            self.block_contents[block] = dict(self.tier_contents[slot])
        for item in self.items:
            tokens = self.sequence(item)
            self.num_placeholders += item.placeholder
            self._check_reads_and_write(item, tokens)
            end = item.start + item.num_tokens
            drafts = item.spec_token_ids
            assert item.placeholder or item.token_ids == tokens[item.start:end - len(drafts)] + drafts, \
                "a chunk computes the request's next tokens, then its proposals"
            assert all(len(t) * self.kv.block_size >= end for t in item.block_ids), \
                "blocks must cover every computed token"
            self._check_held(item, end)
            if item.sample:
                assert end - len(drafts) == len(tokens)
                out.sampled_token_ids[item.request_id] = verify(tokens, drafts)
            else:
                assert not drafts, "proposals come only with the tokens a request lacks"
        self.sampled = dict(out.sampled_token_ids)
        return out


    def _first_read(self, group: int, start: int) -> int:
        """The first key a query at position `start` reads in KV cache group `group` (its window's, or its
        attention chunk's first)."""
        window, chunk = self.kv.windows[group], getattr(self.kv.specs[group], "chunk", None)
        first = 0 if window is None else max(0, start - window + 1)
        return first if chunk is None else max(first, start // chunk * chunk)

    def _check_held(self, item, end: int) -> None:
        """Every block a query of the chunk reads or writes is held by the request (not given back)."""
        bs = self.kv.block_size
        for group, table in enumerate(item.block_ids):
            first = self._first_read(group, item.start)
            for index in range(first // bs, -(-end // bs)):
                assert self.kv.pool.ref_counts[table[index]] > 0, \
                    f"{item.request_id} uses block {table[index]}, which it gave back"


def verify(tokens: list[int], drafts: list[int]) -> list[int]:
    """What greedy verification keeps: the proposals that match next_token, then next_token itself."""
    sequence, kept = list(tokens), []
    for draft in drafts:
        if next_token(sequence) != draft:
            break
        sequence.append(draft)
        kept.append(draft)
    return kept + [next_token(sequence)]


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 32, max_seqs: int = 8,
                   max_model_len: int = 256, watermark: float = 0.0,
                   prefix_caching: bool = False, secondary_slots: int = 0,
                   steps_in_flight: int = 1, windows: tuple = (None,),
                   record_events: bool = False, async_scheduling: bool = False,
                   attachments: tuple = (), chunks: tuple = (), prompt_budget: int = 0) -> tuple[Scheduler, FakeRunner]:
    """A scheduler over a KV cache manager of one group per entry of `windows` (None: full attention,
    W: a sliding window of W tokens; `chunks`, when given, each group's attention chunk C or None), completing
    its steps with `attachments`, and the fake runner it drives."""
    kv = KVCacheManager(num_blocks, block_size, watermark=watermark, enable_prefix_caching=prefix_caching,
                        secondary_slots=secondary_slots, windows=windows, record_events=record_events, chunks=chunks)
    limits = SchedulingLimits(budget, max_seqs, max_model_len, max_steps_in_flight=steps_in_flight,
                              async_scheduling=async_scheduling, max_num_prompt_tokens=prompt_budget)
    scheduler, runner = Scheduler(limits, kv, attachments=attachments), FakeRunner(kv)
    runner.requests = scheduler.requests
    return scheduler, runner


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, priority: int = 0, n: int = 1,
                 seed_token: int = 5, prompt: list[int] | None = None) -> Request:
    if prompt is None:
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
