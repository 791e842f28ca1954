"""The scheduler's other half: what a step's results do to its requests (no torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.core.sched_output import ModelRunnerOutput, RequestUpdate, ScheduledChunk, SchedulerOutput
from tokenmill.request import Request, RequestStatus

if TYPE_CHECKING:
    from tokenmill.core.kv_cache_manager import KVCacheManager
    from tokenmill.core.kv_connector import KVConnectorScheduler
    from tokenmill.core.scheduling import SpecTotals


class StepResults:
    """`Scheduler`'s base class: advancing requests by a step's computed and sampled tokens. It uses the
    scheduler's queues, KV manager and connectors (and its `finish_requests`, `_release`, `_insert`)."""

    kv_cache: KVCacheManager
    connectors: list[KVConnectorScheduler]
    requests: dict[str, Request]
    running: list[Request]
    in_flight: set[str]
    spec_totals: SpecTotals

    def update_from_output(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestUpdate]:
        """Advance requests by what the step computed and sampled; returns one update per request touched."""
        for connector in self.connectors:
            connector.end_step()
        updates = []
        for item in output.scheduled:
            self.in_flight.discard(item.request_id)
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
            self._insert(self.running, child)
        parent.num_samples_to_fork = 0

