"""Structured output around a step, on the engine's side: masks into the step before, tokens into the
grammars after (the runner only applies the masks it is given)."""

from __future__ import annotations

import logging
from typing import Mapping

from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.request import Request
from tokenmill.structured.compiler import GrammarCache
from tokenmill.structured.matchers import GrammarMatchers

logger = logging.getLogger(__name__)


class StepGrammars:
    """Owns the matchers of the constrained requests and keeps them in step with what the engine keeps."""

    def __init__(self, cache: GrammarCache) -> None:
        self.matchers = GrammarMatchers(cache)

    def prepare(self, schedule: SchedulerOutput, requests: Mapping[str, Request]) -> dict[str, Exception]:
        """Forget finished requests' matchers and put the masks of the step's constrained sampling rows into
        `schedule.grammar`. Returns the requests whose grammar raised (each fails alone, after the step)."""
        for request_id in schedule.finished_request_ids:
            self.matchers.drop(request_id)
        rows, failures = [], {}
        for chunk in schedule.scheduled:
            spec = requests[chunk.request_id].sampling_params.structured_output
            if spec is not None and chunk.sample:
                rows.append((chunk.request_id, spec, chunk.spec_token_ids))
        if not rows:
            return failures
        try:
            schedule.grammar = self.matchers.masks(rows)
        except Exception:
            kept = []  # find the rows that raise, and mask the rest
            for row in rows:
                try:
                    self.matchers.masks([row])
                    kept.append(row)
                except Exception as exc:
                    failures[row[0]] = exc
            schedule.grammar = self.matchers.masks(kept) if kept else None
        return failures

    def finish(self, schedule: SchedulerOutput, result: ModelRunnerOutput, failures: dict[str, Exception]) -> None:
        """Feed each constrained request's kept tokens to its matcher, cut them where its grammar completed
        (marking it `completed`), and fail the requests whose grammar raised."""
        for request_id, exc in failures.items():
            _fail(result, request_id, exc)
        constrained = {} if schedule.grammar is None else schedule.grammar.rows
        for request_id in constrained:
            tokens = result.sampled_token_ids.get(request_id)
            if tokens is None:
                continue
            try:
                kept, completed = self.matchers.advance(request_id, tokens)
            except Exception as exc:
                _fail(result, request_id, exc)
                continue
            if completed:
                result.completed.add(request_id)
            result.sampled_token_ids[request_id] = kept


def _fail(result: ModelRunnerOutput, request_id: str, exc: Exception) -> None:
    logger.warning("request %s failed in its grammar: %s: %s", request_id, type(exc).__name__, exc)
    result.fail(request_id, exc)
