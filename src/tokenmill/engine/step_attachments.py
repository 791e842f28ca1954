"""The engine's parts that complete each step the scheduler builds (core/scheduler.py's `StepAttachment`):
the distributions a draft drew its proposals from, the grammar masks of constrained rows, and the LoRA
adapters to unload. The engine gives them to the scheduler at construction; the scheduler calls them."""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping, Optional

from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.engine.lora_registry import LoRARegistry
from tokenmill.request import Request
from tokenmill.structured.compiler import GrammarCache
from tokenmill.structured.step_grammars import StepGrammars


class DraftProbs:
    """Speculative decoding's share of a step (`SchedulerOutput.spec_probs`): the distributions a draft drew
    its proposals from, held from the round that made them to the step that verifies them."""

    def __init__(self) -> None:
        self._probs: dict[str, Any] = {}  # request id -> [len(proposals), vocab] distribution

    def hold(self, probs: dict[str, Any]) -> None:
        """The distributions of the proposals just made, by request id; they replace those still held
        (proposals the step after their making does not verify are stale, `Scheduler.set_proposals`)."""
        self._probs = probs

    def attach(self, output: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """Give each chunk of `output` that verifies proposals the distribution held for them (once)."""
        if self._probs:
            output.spec_probs = {c.request_id: probs for c in output.scheduled
                                 if c.spec_token_ids and (probs := self._probs.pop(c.request_id, None)) is not None}


class GrammarMasking:
    """Structured output's share of a step (`SchedulerOutput.grammar`): the masks of its constrained sampling
    rows, from the matchers of `StepGrammars`. The matchers and the compiled-grammar cache are built on first
    use (`cache`, from any thread); until then it attaches nothing."""

    def __init__(self, make_cache: Callable[[], GrammarCache]) -> None:
        self._make_cache = make_cache
        self._cache: Optional[GrammarCache] = None
        self._lock = threading.Lock()
        self.step_grammars: Optional[StepGrammars] = None  # set once, with the cache
        # the requests whose grammar raised while the last step attached was masked; the engine takes them
        # (`take_failures`) right after each `Scheduler.schedule`, before the next can replace them
        self._failures: dict[str, Exception] = {}

    @property
    def cache(self) -> GrammarCache:
        """The compiled-grammar cache (built, with the step's matchers, on the first call)."""
        with self._lock:
            if self._cache is None:
                cache = self._make_cache()
                self.step_grammars = StepGrammars(cache)
                self._cache = cache
            return self._cache

    def attach(self, output: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """Put the masks of `output`'s constrained rows into `output.grammar` (`StepGrammars.prepare`)."""
        grammars = self.step_grammars
        self._failures = grammars.prepare(output, requests) if grammars is not None else {}

    def take_failures(self) -> dict[str, Exception]:
        """The requests whose grammar raised while the step last attached was masked (each fails alone, when
        its step is finished: `finish`)."""
        failures, self._failures = self._failures, {}
        return failures

    def finish(self, output: SchedulerOutput, result: ModelRunnerOutput, failures: dict[str, Exception]) -> None:
        """After the step `output`: advance the matchers by `result`'s kept tokens, and fail the requests in
        `failures` (`StepGrammars.finish`)."""
        grammars = self.step_grammars
        if grammars is not None:
            grammars.finish(output, result, failures)


class LoRAUnloads:
    """The LoRA registry's share of a step (`SchedulerOutput.lora_unloads`): the removed adapters that no
    live request uses any more, for the runner to free before the step."""

    def __init__(self, registry: LoRARegistry, steps_in_flight: Callable[[], int]) -> None:
        self.registry = registry
        self._steps_in_flight = steps_in_flight

    def attach(self, output: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """Take the registry's unloads into `output`, unless the engine will drop it: with nothing else to do
        while other steps are in flight (`LLMEngine._submit_next`), where they would be lost."""
        if not output.has_work() and self._steps_in_flight():
            return
        # the scheduler's unfinished requests are exactly its running and waiting ones
        output.lora_unloads = self.registry.take_unloads(
            r.sampling_params.lora_request.lora_int_id for r in requests.values()
            if not r.status.finished and r.sampling_params.lora_request)
