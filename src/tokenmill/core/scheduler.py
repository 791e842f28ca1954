"""Continuous batching with chunked prefill, and preemption by recompute or by swapping (no torch)."""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Optional, Protocol, Sequence

from tokenmill.core.fair_share import FairShare
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_connector import KVConnectorScheduler
from tokenmill.core.runner_views import RunnerViews
from tokenmill.core.sched_output import ModelRunnerOutput, RequestUpdate, ScheduledChunk, SchedulerOutput
from tokenmill.core.scheduling import SchedulingLimits, SpecTotals
from tokenmill.core.swap_space import SwapSpace
from tokenmill.multimodal.inputs import overlapping
from tokenmill.request import Request, RequestStatus


def _priority_key(request: Request) -> tuple:
    return request.priority_key


# Under lpm, a waiting request passed over this many times is admitted next: no starvation.
MAX_TIMES_PASSED_OVER = 8


class _EncoderBudget:
    """What is left of one step's vision-encoder budget (image positions; 0: no limit)."""

    def __init__(self, limit: int) -> None:
        self.limit = self.left = limit

    def fit(self, request: Request, start: int, num_new: int, first_chunk: bool = False) -> int:
        """`num_new` cut before the first image the chunk from `start` begins that the budget cannot take
        (the whole chunk when it can take them all), charging the budget for those it takes. An image begun
        in an earlier chunk costs nothing: its embeddings wait in the runner's encoder cache. A request's
        first chunk (`first_chunk`: after a prefix-cache hit it may start inside an image) pays for every
        image it touches."""
        if not self.limit or not request.images:
            return num_new
        end = start + num_new
        for image in overlapping(request.images, start, end):
            if image.offset < start and not first_chunk:
                continue
            if image.length > self.left and self.left < self.limit:
                return max(0, image.offset - start)
            self.left -= min(image.length, self.left)
        return num_new


@dataclass(slots=True)
class InFlight:
    """A request's share of the steps sent to the runner and not yet updated: the tokens they compute, and
    how many of them sample a token the host does not know yet (each stands as a placeholder)."""

    tokens: int = 0
    samples: int = 0


class StepAttachment(Protocol):
    """A part that writes its own fields of every step the scheduler builds (the engine's are in
    engine/step_attachments.py: draft distributions, grammar masks, adapters to unload), so that the
    scheduler alone hands out the step contract. Each is called once per `Scheduler.schedule`, in the order
    the scheduler was given them, once the step's chunks, diffs and copies are final."""

    def attach(self, output: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """Write this part's fields of `output`; `requests` are the scheduler's, by id (read only)."""


def _adapter(request: Request) -> Optional[int]:
    """The request's LoRA adapter id (None: the base model)."""
    lora = request.sampling_params.lora_request
    return None if lora is None else lora.lora_int_id


class Scheduler:
    """Decides, each step, which requests compute how many tokens, and advances them by what each step
    computed and sampled (`update_from_output`).

    Every step hands out a token budget: running requests first (in priority order), then waiting
    ones. A request gets min(tokens it lacks, budget left), so long prompts are chunked and mixed
    with decode tokens of other requests in the same step. When the pool cannot hold a running
    request's next tokens, the lowest-priority, latest-arriving running request is preempted: its
    blocks are freed and it restarts from num_computed_tokens = 0 (recompute), or they wait in the
    swap space and come back when it resumes (core/swap_space.py).

    Invariant: `running` and `waiting` are both sorted by Request.priority_key, so the preemption
    victim is always running[-1] and, under fcfs with one tenant, the next admission is always waiting[0].

    Tenants (Request.tenant) share the engine by weighted fair queuing on tokens (core/fair_share.py): the next
    admission is the first waiting request of the head's class and priority whose tenant was served the fewest
    tokens for its weight; a running prompt's chunk waits a step while a waiting request of another tenant
    served no more than its own can start, so that it starts in a short step; and with every seat of the batch
    taken, tenants below their weighted share of seats take them from tenants above their own (the victims
    preempted before the step is built, only with no step in flight). Which requests run changes, never what a
    request computes.

    Steps in flight: a step may be built while earlier ones still run, up to `limits.max_steps_in_flight`
    (pipeline stages), or one ahead of the step running with async scheduling. Nothing is preempted
    while any step is in flight: a step that cannot grow a request's blocks stops there, and the request
    waits for the steps ahead to come back. A request in a step in flight is scheduled again only with
    async scheduling, only when that step is its only one in flight, and only when its next step needs
    nothing of the token that step samples but its value on the device (`_may_overlap`): its next chunk
    is then one token, the placeholder, which the runner fills from the previous step's sampled ids.
    Its stops (EOS, stop ids, max_tokens, stop strings) are found when that step's output comes back,
    one step late: the following step's output for it is dropped (`update_from_output` skips a request
    that finished), never appended, counted or cached.
    """

    def __init__(self, limits: SchedulingLimits, kv_cache: KVCacheManager, swap_slots: int = 0,
                 attachments: Sequence[StepAttachment] = ()) -> None:
        self.limits = limits
        self.attachments = tuple(attachments)  # they complete every step `schedule` returns, in this order
        self.kv_cache = kv_cache
        # swap slots come only with groups that keep every block (config_checks.swaps_preempted)
        assert not swap_slots or all(spec.keeps_every_block for spec in kv_cache.specs), \
            "swapping moves whole tables: no windowed KV cache group"
        # preempted requests' blocks, while they wait (None: every preemption recomputes)
        self.swap = SwapSpace(swap_slots) if swap_slots and limits.preemption_mode != "recompute" else None
        # every way KV moves in or out of the pool, in the order the runner does each phase's copies
        # (core/kv_connector.py): transfer imports, then second-tier loads, then swap-ins
        self.connectors: list[KVConnectorScheduler] = [
            c for c in (kv_cache.transfer, kv_cache.tier_connector, self.swap) if c is not None]
        self.num_recomputed_tokens = 0  # computed tokens dropped by preemptions, to be computed again
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._finished_since_last_step: list[str] = []
        self._runner_views = RunnerViews()
        self.in_flight: dict[str, InFlight] = {}  # requests in steps sent to the runner and not yet updated
        self.num_preemptions_total = 0
        self.spec_totals = SpecTotals()
        self.fair = FairShare()
        self._deferred_for: set[str] = set()  # waiting requests the last step deferred prompt chunks for

    # ------------------------------------------------------------------ admission
    def check_admissible(self, prompt_len: int, max_total_tokens: int) -> None:
        """Raise ValueError if a request of this size could never run; the message gives the numbers."""
        max_len = self.limits.max_model_len
        if prompt_len > max_len:
            raise ValueError(
                f"The prompt has {prompt_len} tokens, more than the model's maximum context length "
                f"of {max_len} tokens.")
        if max_total_tokens > max_len:
            raise ValueError(
                f"This model's maximum context length is {max_len} tokens, but {max_total_tokens} "
                f"were requested ({prompt_len} in the prompt + {max_total_tokens - prompt_len} for "
                f"max_tokens).")
        needed = self.kv_cache.max_blocks_held(max_total_tokens, self.limits.max_num_batched_tokens)
        if needed > self.kv_cache.num_blocks:
            raise ValueError(
                f"The request needs up to {max_total_tokens} tokens of KV cache ({prompt_len} prompt + "
                f"{max_total_tokens - prompt_len} max_tokens): {needed} blocks of {self.kv_cache.block_size} "
                f"tokens, and the whole KV cache holds {self.kv_cache.num_blocks} blocks.")

    def add_request(self, request: Request) -> None:
        """Queue a request. Precondition: `check_admissible` passed for its sizes (the engine's input
        processor checks every request once, engine/input_processor.py)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.fair.activate(request)
        self.requests[request.request_id] = request
        self._insert(self.waiting, request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[str]:
        """Finish (abort, or stop on a stop string) the named requests; returns those that were live."""
        done = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.status.finished:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            request.num_samples_to_fork = 0
            self._release(request)
            done.append(rid)
        return done

    def recompute_everything(self) -> None:
        """The workers' state is lost (their group was replaced): every running request and every swapped-out one
        goes back to the waiting queue to recompute its prompt and the tokens it already produced (as a preemption
        by recompute: what it streamed stays, and batch invariance makes the rest the same), nothing is in flight
        and the runner knows no request. The caller resets the prefix cache once the blocks are free."""
        self.in_flight.clear()
        while self.running:
            request = self.running.pop()
            request.spec_token_ids = []
            self._drop_computed(request)
            request.status = RequestStatus.WAITING
            self._insert(self.waiting, request)
        for request in self.waiting:
            if self.swap is not None and self.swap.holds(request.request_id):
                self.swap.drop(request.request_id)
                self._drop_computed(request)
        self._finished_since_last_step = []
        self._runner_views = RunnerViews()

    def set_proposals(self, proposals: dict[str, list[int]]) -> None:
        """The next step's speculative proposals: each running request named gets its own, every other
        running request none (proposals not verified in the step after they were made are stale)."""
        for request in self.running:
            request.spec_token_ids = list(proposals.get(request.request_id, ()))

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ results
    def update_from_output(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestUpdate]:
        """Advance requests by what the step computed and sampled; returns one update per request touched."""
        for connector in self.connectors:
            connector.end_step()
        updates = []
        for item in output.scheduled:
            flight = self.in_flight[item.request_id]
            flight.tokens -= item.num_tokens
            flight.samples -= item.sample
            if not flight.tokens:
                del self.in_flight[item.request_id]
            request = self.requests.get(item.request_id)
            if request is None or request.status.finished:
                continue  # finished (e.g. aborted) while the step ran
            update = RequestUpdate(item.request_id, first_scheduled_time=request.first_scheduled_time,
                                   num_cached_tokens=request.num_cached_tokens)
            error = result.failed.get(item.request_id)
            if error is not None:  # its blocks return to the pool; the rest of the batch is unaffected
                self.finish_requests([item.request_id], RequestStatus.FINISHED_ERROR)
                update.finish_reason, update.error = RequestStatus.FINISHED_ERROR.value, error
                updates.append(update)
                continue
            if item.request_id in result.prompt_logprobs:
                update.new_prompt_logprobs = result.prompt_logprobs[item.request_id]
                update.prompt_logprobs_start = item.start + 1
            request.num_computed_tokens += item.num_tokens
            request.spec_token_ids = []
            if item.sample:
                if request.num_samples_to_fork:
                    self._fork_samples(request)
                self._append_sampled(request, item, result, update)
            self.kv_cache.cache_computed_blocks(request)
            if request.status.finished:
                self.running.remove(request)
                self._release(request)
                update.finish_reason = request.status.value
                update.stop_reason = request.stop_reason
            updates.append(update)
        return updates

    def _append_sampled(self, request: Request, item: ScheduledChunk, result: ModelRunnerOutput,
                        update: RequestUpdate) -> None:
        """Append the step's tokens (accepted proposals, then the sampled one) up to the first that
        stops the request, and roll num_computed_tokens and the block table back past rejected proposals."""
        tokens = result.sampled_token_ids[item.request_id]
        num_drafts = len(item.spec_token_ids)
        if num_drafts:
            accepted = len(tokens) - 1
            update.num_draft_tokens, update.num_accepted_tokens = num_drafts, accepted
            self.spec_totals.add(num_drafts, accepted)
            request.num_computed_tokens -= num_drafts - accepted
        logprobs = result.logprobs.get(item.request_id)
        for index, token in enumerate(tokens):
            request.output_token_ids.append(token)
            update.new_token_ids.append(token)
            if logprobs is not None:
                update.new_logprobs.append(logprobs[index])
            if request.check_stop_token(token):
                break
        # A complete output grammar ends the request as a stop, even on its max_tokens-th token: the
        # runner cut the tokens at the completing one, so it is the last appended.
        if item.request_id in result.completed and request.status is not RequestStatus.FINISHED_STOPPED:
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, None
        if num_drafts:
            self.spec_totals.emitted_tokens += len(update.new_token_ids)
            # The KV of tokens past a stop is not part of the sequence: it must not be cached as computed.
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
            self.kv_cache.trim(request.request_id, request.num_computed_tokens)

    def _fork_samples(self, parent: Request) -> None:
        """Start samples 1..n-1 of an n>1 request, sharing the prompt's full blocks with it.

        Each child recomputes at least the last prompt token (to get its own logits), so it shares
        only the blocks before the one holding that token.
        """
        params = parent.sampling_params
        for index in range(1, parent.num_samples_to_fork + 1):
            child_id = f"{parent.request_id}#{index}"
            shared = self.kv_cache.fork(parent.request_id, child_id, parent.num_prompt_tokens - 1)
            child = parent.fork(child_id, params.for_sample(index), shared)
            self.requests[child_id] = child
            self.fair.activate(child)
            self._insert(self.running, child)
        parent.num_samples_to_fork = 0

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        """Build this step's batch, completed by the `attachments`. Invariant of the step contract: every
        output must reach the runner, in order (it carries diffs against the previous ones), before the next
        is built."""
        budget = self.limits.max_num_batched_tokens
        prompt_budget = self.limits.max_num_prompt_tokens or budget  # (decodes do not count against it)
        scheduled: list[ScheduledChunk] = []
        num_preempted = 0
        seats_given = self._give_seats()
        room = self._step_share()
        stalled = False
        encoder = _EncoderBudget(self.limits.max_num_encoder_input_tokens)
        leader, checked = self._fair_leader(min(budget, prompt_budget))
        uncapped = self._newcomer(leader)

        index = 0
        while index < len(self.running) and budget > 0 and room > 0:
            request = self.running[index]
            flight = self.in_flight.get(request.request_id)
            if flight is not None and not self._may_overlap(request, flight):
                index += 1
                continue
            start, known_end = self._next_span(request, flight)
            if not request.num_samples_to_fork:  # a parent about to fork keeps what its samples will share
                self.kv_cache.release_out_of_window(request.request_id, request.num_computed_tokens)
            prompt = known_end - start > 1  # a chunk of its prompt (or of recomputed tokens), not a decode
            capped = prompt and not (uncapped is not None and self.fair.serves(request, uncapped))
            if capped and prompt_budget <= 0:  # the step's prompt tokens are spent
                index += 1
                continue
            if prompt and leader is not None and self.fair.defers(request, leader):
                self._deferred_for = checked  # its prompt chunk waits a step for another tenant's
                index += 1  # (a decode never waits)
                continue
            num_new = encoder.fit(request, start, self._grant(request, start, known_end,
                                                              min(budget, prompt_budget) if capped else budget))
            if num_new == 0:  # its next image waits for the next step's encoder budget
                index += 1
                continue
            while not self.kv_cache.allocate_slots(request.request_id, start + num_new):
                if request.spec_token_ids:  # proposals are optional: drop them before preempting anyone
                    request.spec_token_ids = []
                    num_new = self._grant(request, start, known_end, budget)
                    continue
                if self.in_flight:  # no preemption under a step in flight: wait for it instead
                    stalled = True
                    break
                victim = self.running.pop()
                self._preempt(victim)
                num_preempted += 1
                if victim is request:
                    break
            else:
                scheduled.append(self._scheduled(request, start, num_new, known_end))
                budget -= num_new
                prompt_budget -= num_new if prompt else 0
                room -= 1
                index += 1
                continue
            if stalled:
                break

        if num_preempted == 0 and not stalled:
            self._admit_waiting(budget, prompt_budget, room, scheduled, encoder, uncapped,
                                leader if self._deferred_for else None)

        self.kv_cache.transfer.plan_exports(scheduled, self.requests)
        copies = [c for c in (connector.take_copies() for connector in self.connectors) if c]
        output = SchedulerOutput(scheduled, finished_request_ids=self._finished_since_last_step,
                                 num_preempted=num_preempted + seats_given, kv_copies=copies)
        for connector in self.connectors:
            connector.step_built()
        self._runner_views.describe(output, self.requests, self.kv_cache)
        for chunk in scheduled:
            flight = self.in_flight.setdefault(chunk.request_id, InFlight())
            flight.tokens += chunk.num_tokens
            flight.samples += chunk.sample
        self._finished_since_last_step = []
        self.num_preemptions_total += num_preempted + seats_given
        for attachment in self.attachments:
            attachment.attach(output, self.requests)
        return output

    def _seats_taken(self) -> int:
        """The running batch's sequences: each running request and the samples it will fork."""
        return sum(1 + r.num_samples_to_fork for r in self.running)

    def _give_seats(self) -> int:
        """With every seat of the batch taken and no step in flight, preempt the running requests that waiting
        tenants below their weighted share of seats take from tenants above their own (FairShare.seat_victims).
        Returns how many were preempted."""
        if self.in_flight or not self.waiting:
            return 0
        seats = self.limits.max_num_seqs
        if self._seats_taken() < seats:
            return 0
        victims = self.fair.seat_victims(self.running, self.waiting, seats)
        for victim in victims:
            self.running.remove(victim)
            self._preempt(victim)
        return len(victims)

    def _fair_leader(self, budget: int) -> tuple[Optional[tuple], set[str]]:
        """FairShare.leader for this step (the tenant served next whose first waiting request finds a seat and KV
        blocks for its first chunk now) and the ids of the requests checked. None when the previous step deferred
        prompt chunks for requests that are still waiting (what they lacked was not what the check sees): the
        deferred prompts then run, so they move on at least every other step whatever happens."""
        waited_in_vain = any(self.requests.get(rid) in self.waiting for rid in self._deferred_for)
        self._deferred_for = set()
        if waited_in_vain or not self.waiting or self.fair.num_live_tenants < 2:
            return None, set()
        seats_taken = self._seats_taken()
        checked: set[str] = set()

        def can_start(request: Request) -> bool:
            checked.add(request.request_id)
            return (seats_taken + 1 + request.num_samples_to_fork <= self.limits.max_num_seqs
                    and self.kv_cache.can_admit(request.request_id, min(request.num_tokens, budget)))

        return self.fair.leader(self.waiting, self.running, can_start), checked

    def _newcomer(self, leader: Optional[tuple]) -> Optional[str]:
        """The tenant whose prompts this step runs past max_num_prompt_tokens: the fair share's `leader` when none of
        its running requests has prompt tokens left (it has just come, or come back). The cap keeps steps short for a
        tenant that arrives while one runs; that tenant's own prompts then run at once, not in capped steps beside
        the others' work. None without a cap or a leader."""
        if leader is None or not self.limits.max_num_prompt_tokens:
            return None
        tenant = leader[0]
        if any(self.fair.serves(r, tenant) and r.num_tokens - r.num_computed_tokens > 1 for r in self.running):
            return None
        return tenant

    def _step_share(self) -> int:
        """How many requests this step may take: all of them with one step in flight at a time, else an
        even share of the live requests (at least one), so consecutive steps run disjoint requests."""
        steps = self.limits.max_steps_in_flight
        if steps == 1:
            return len(self.running) + len(self.waiting)
        return max(1, -(-(len(self.running) + len(self.waiting)) // steps))

    def _may_overlap(self, request: Request, flight: InFlight) -> bool:
        """Whether the running `request`, in a step in flight, may be scheduled again now (see the class):
        with async scheduling, in one step in flight only, with its last known token still short of its
        limit, and nothing of the placeholder's value needed on the host (`Request.needs_last_token`)."""
        if not self.limits.async_scheduling or flight.samples > 1 or self.limits.speculative:
            return False
        if flight.samples and (request.needs_last_token or request.num_tokens + 1 >= request.max_total_tokens):
            return False
        return True

    def _next_span(self, request: Request, flight: Optional[InFlight]) -> tuple[int, int]:
        """(first position the request's next chunk computes, the end of its tokens counting placeholders)."""
        if flight is None:
            return request.num_computed_tokens, request.num_tokens
        return request.num_computed_tokens + flight.tokens, request.num_tokens + flight.samples

    @staticmethod
    def _grant(request: Request, start: int, known_end: int, budget: int) -> int:
        """Tokens the running `request` computes this step from `start`: what it lacks up to `known_end`,
        then as many of its speculative proposals as the budget leaves room for (the others are dropped)."""
        lacking = known_end - start
        if request.spec_token_ids:
            request.spec_token_ids = request.spec_token_ids[:max(0, budget - lacking)]
        return min(lacking + len(request.spec_token_ids), budget)

    def _admit_waiting(self, budget: int, prompt_budget: int, room: int, scheduled: list[ScheduledChunk],
                       encoder: "_EncoderBudget", uncapped: Optional[str] = None,
                       deferring: Optional[tuple] = None) -> None:
        """Admit waiting requests while the budget, the seats and the pool allow; a first chunk takes at most
        `prompt_budget` (what the step's prompt tokens have left), but for the `uncapped` tenant's requests
        (`_newcomer`). `deferring`: the tenant this step's running prompt chunks waited for (FairShare.leader); a
        waiting request whose chunk would wait for it too is not admitted in this step either."""
        num_seqs = self._seats_taken()
        computing = set()  # keys of full blocks that requests admitted in this step compute
        adapters = {_adapter(r) for r in self.running} - {None}  # the LoRA adapters this step runs
        passed_over: set[str] = set()  # waiting requests whose adapter does not fit this step, or that wait a step
        while len(self.waiting) > len(passed_over) and budget > 0 and room > 0:
            request = self._next_waiting(passed_over)
            if num_seqs + 1 + request.num_samples_to_fork > self.limits.max_num_seqs:
                break
            if deferring is not None and self.fair.defers(request, deferring):
                passed_over.add(request.request_id)
                continue
            adapter = _adapter(request)
            if adapter is not None and adapter not in adapters and 0 < self.limits.max_loras <= len(adapters):
                passed_over.add(request.request_id)
                continue
            cap = budget if uncapped is not None and self.fair.serves(request, uncapped) else min(budget, prompt_budget)
            if cap <= 0:  # the step's prompt tokens are spent
                passed_over.add(request.request_id)
                continue
            if self.swap is not None and self.swap.holds(request.request_id):
                num_new = self._swap_in(request, cap)
                if num_new is None:
                    break
                budget, room, num_seqs = budget - num_new, room - 1, num_seqs + 1 + request.num_samples_to_fork
                prompt_budget -= num_new if num_new > 1 else 0
                adapters |= {adapter} - {None}
                scheduled.append(self._scheduled(request, request.num_computed_tokens, num_new, request.num_tokens))
                continue
            # Cached tokens cost neither budget nor compute: the request starts past them. A request
            # that wants prompt logprobs must compute every prompt position, so it takes no hit.
            cached_blocks, num_cached = [], 0
            if request.sampling_params.prompt_logprobs is None:
                cached_blocks, num_cached = self.kv_cache.match_prefix(request, request.num_tokens)
            # A request whose next block another request admitted in this step is computing waits one
            # step and then finds it cached, instead of computing the same prefix again (a cold batch).
            upcoming = self.kv_cache.prefix_keys_between(request, num_cached, num_cached + self.kv_cache.block_size)
            if upcoming and upcoming[0] in computing:
                break
            num_new = encoder.fit(request, num_cached, min(request.num_tokens - num_cached, cap), True)
            if num_new == 0:
                break
            target = num_cached + num_new
            # With nothing running there is nobody to keep the watermark for: admit if it fits at all.
            if self.running and not self.kv_cache.can_admit(request.request_id, target, cached_blocks):
                break
            if not self.kv_cache.allocate_slots(request.request_id, target, cached_blocks):
                break
            computing.update(self.kv_cache.prefix_keys_between(request, num_cached, target))
            self.kv_cache.record_lookup(request.request_id, request.num_tokens, num_cached)
            request.num_computed_tokens = num_cached
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_cached
            self._insert(self.running, request)
            scheduled.append(self._scheduled(request, num_cached, num_new, request.num_tokens))
            budget -= num_new
            prompt_budget -= num_new
            room -= 1
            num_seqs += 1 + request.num_samples_to_fork
            if adapter is not None:
                adapters.add(adapter)

    def _swap_in(self, request: Request, budget: int) -> Optional[int]:
        """Resume a swapped-out request: blocks for its computed tokens and the next chunk, its slots copied
        back into the first of them. Returns the chunk's tokens, or None when the pool cannot hold it."""
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        target = request.num_computed_tokens + num_new
        if self.running and not self.kv_cache.can_admit(request.request_id, target):
            return None
        if not self.kv_cache.allocate_slots(request.request_id, target):
            return None
        self.swap.swap_in(self.kv_cache, request.request_id, request.num_computed_tokens)
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self._insert(self.running, request)
        return num_new

    def _next_waiting(self, passed_over: set[str]) -> Request:
        """Of the waiting requests not `passed_over`, among the head's class and priority, those of the tenant
        next in the fair share; of them, fcfs: the first. lpm: the one with the longest cached prefix (ties:
        earliest), unless one was passed over too often — it goes first."""
        def candidates() -> Iterator[Request]:
            return (r for r in self.waiting if r.request_id not in passed_over) if passed_over else iter(self.waiting)

        tenant = self.fair.choose(candidates(), self.running)
        head = next(candidates())
        # the head's class and priority (a prefix of the sorted queue), of the tenant served next
        peers = (r for r in candidates() if self.fair.serves(r, tenant))
        if self.limits.policy != "lpm":
            return next(peers)  # (the chosen tenant has a request in the head's class: it comes first)
        peers = list(itertools.takewhile(lambda r: r.priority_key[:2] == head.priority_key[:2], peers))
        if len(peers) == 1:
            return peers[0]
        chosen = next((r for r in peers if r.num_times_passed_over >= MAX_TIMES_PASSED_OVER), None)
        if chosen is None:
            chosen = max(peers, key=lambda r: (self.kv_cache.num_cached_tokens(r, r.num_tokens), -r.arrival_seq))
        for r in peers:
            if r.arrival_seq < chosen.arrival_seq:
                r.num_times_passed_over += 1
        return chosen

    def _scheduled(self, request: Request, start: int, num_new: int, known_end: int) -> ScheduledChunk:
        """The chunk of `num_new` tokens from `start`, charged to the request's tenant at once (so the same
        step's admissions see it); it samples when it reaches `known_end` (the request's tokens and
        placeholders). Invariant (from _grant): proposals come only with every token it lacks."""
        self.fair.charge(request, num_new)
        real = num_new - len(request.spec_token_ids)
        return ScheduledChunk(request.request_id, start, num_new, start + real == known_end,
                              list(request.spec_token_ids))

    def _preempt(self, request: Request) -> None:
        request.spec_token_ids = []
        if self._swaps(request) and self.swap.swap_out(self.kv_cache, request.request_id):
            pass  # its computed tokens wait in the swap space: num_computed_tokens stands
        else:
            self._drop_computed(request)
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self._insert(self.waiting, request)

    def _drop_computed(self, request: Request) -> None:
        """Free the request's blocks: what it computed is to be computed again (counted in num_recomputed_tokens)."""
        self.kv_cache.free(request.request_id)
        self.num_recomputed_tokens += request.num_computed_tokens
        request.num_computed_tokens = 0

    def _swaps(self, request: Request) -> bool:
        """Whether the preempted `request` should go to the swap space rather than be recomputed."""
        mode = self.limits.preemption_mode
        if self.swap is None or mode == "recompute" or request.num_computed_tokens == 0:
            return False
        return mode == "swap" or self.limits.costs.swap_is_cheaper(request.num_computed_tokens)

    def _release(self, request: Request) -> None:
        self.fair.retire(request)
        if self.swap is not None:
            self.swap.drop(request.request_id)
        self.kv_cache.free(request.request_id)
        self._finished_since_last_step.append(request.request_id)

    def pop_finished(self, request_id: str) -> Optional[Request]:
        """Forget a finished request (the engine calls this once it has emitted the final output)."""
        request = self.requests.get(request_id)
        if request is not None and request.status.finished:
            del self.requests[request_id]
            return request
        return None

    @staticmethod
    def _insert(queue: list[Request], request: Request) -> None:
        queue.insert(bisect.bisect_right(queue, request.priority_key, key=_priority_key), request)

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued (including preempted ones)."""
        return len(self.waiting)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens the waiting requests still have to compute (prompts, and outputs of preempted ones)."""
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
