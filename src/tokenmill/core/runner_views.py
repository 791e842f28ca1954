"""What the runner has been told of each request, and the step contract's diffs against it (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenmill.request import Request


@dataclass
class _RunnerView:
    """What the runner has been told of a request: how many output tokens, and which block table."""

    num_output_tokens: int
    block_ids: list[list[int]]  # per KV cache group


def _common_prefix(sent: list[int], table: list[int]) -> int:
    """How many leading entries of `table` equal what the runner was sent."""
    if len(table) >= len(sent) and table[:len(sent)] == sent:
        return len(sent)
    return next(i for i, (a, b) in enumerate(zip(sent, table + [None])) if a != b)


class RunnerViews:
    """The runner's view of every request it holds.

    Invariant: a request is here from the step that first sends it to the runner until the step that
    reports it finished; the runner's state for it equals this view after each step."""

    def __init__(self) -> None:
        self._views: dict[str, _RunnerView] = {}

    def describe(self, output: SchedulerOutput, requests: Mapping[str, Request], kv_cache: KVCacheManager) -> None:
        """Fill the step's request data: in full for a request the runner has not seen, else the diff
        since it last saw it (new output tokens, block table changes)."""
        for request_id in output.finished_request_ids:
            self._views.pop(request_id, None)
        for chunk in output.scheduled:
            request = requests[chunk.request_id]
            tables = kv_cache.block_tables(chunk.request_id)
            view = self._views.get(chunk.request_id)
            if view is None:
                self._views[chunk.request_id] = _RunnerView(len(request.output_token_ids), [list(t) for t in tables])
                output.new_requests.append(NewRequestData(chunk.request_id, request.prompt_token_ids,
                                                          list(request.output_token_ids),
                                                          request.sampling_params, [list(t) for t in tables],
                                                          request.images))
                continue
            keeps = [_common_prefix(sent, table) for sent, table in zip(view.block_ids, tables)]
            new_tokens = request.output_token_ids[view.num_output_tokens:]
            changed = any(keep < len(sent) or len(table) > keep
                          for keep, sent, table in zip(keeps, view.block_ids, tables))
            if new_tokens or changed:
                output.cached_requests.append(CachedRequestData(
                    chunk.request_id, new_tokens, [table[keep:] for keep, table in zip(keeps, tables)], keeps))
                view.num_output_tokens = len(request.output_token_ids)
                for keep, sent, table in zip(keeps, view.block_ids, tables):
                    del sent[keep:]
                    sent.extend(table[keep:])
