"""The scheduler alone writes the step contract: the engine's parts (drafts' distributions, grammar masks,
LoRA unloads) complete each step through the scheduler's attachments (core/scheduler.py,
engine/step_attachments.py)."""

from __future__ import annotations

import dataclasses

from fake_runner import make_request, make_scheduler

from tokenmill.core.sched_output import ScheduledChunk, SchedulerOutput
from tokenmill.engine.step_attachments import DraftProbs, LoRAUnloads
from tokenmill.lora.request import LoRARequest
from tokenmill.request import RequestStatus


class Recording:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def attach(self, output, requests) -> None:
        self.log.append((self.name, output, requests))


def test_each_step_is_completed_by_the_attachments_in_order_once_it_is_final():
    log: list = []
    seen_in_flight = []

    class Final(Recording):
        def attach(self, output, requests) -> None:
            seen_in_flight.append(dict(scheduler.in_flight))
            super().attach(output, requests)

    scheduler, runner = make_scheduler(attachments=(Recording("first", log), Final("second", log)))
    scheduler.add_request(make_request("a", 6))
    output = scheduler.schedule()
    assert [(name, out is output, requests is scheduler.requests) for name, out, requests in log] == \
        [("first", True, True), ("second", True, True)]
    assert seen_in_flight[0]["a"].tokens == 6  # the step's own bookkeeping is done before
    scheduler.update_from_output(output, runner.execute(output))
    scheduler.schedule()
    assert len(log) == 4


def test_draft_distributions_go_once_to_the_chunks_that_verify_their_proposals():
    drafts = DraftProbs()
    drafts.hold({"a": "qa", "b": "qb"})
    output = SchedulerOutput([ScheduledChunk("a", 4, 3, True, [7, 8]), ScheduledChunk("b", 2, 1, True)])
    drafts.attach(output, {})
    assert output.spec_probs == {"a": "qa"}
    again = SchedulerOutput([ScheduledChunk("a", 6, 3, True, [7, 8])])
    drafts.attach(again, {})
    assert again.spec_probs == {}


class Registry:
    def __init__(self, retired: list[int]) -> None:
        self.retired, self.in_use = retired, None

    def take_unloads(self, in_use) -> list[int]:
        self.in_use = set(in_use)
        free, self.retired = [i for i in self.retired if i not in self.in_use], []
        return free


def _with_adapter(rid: str, lora_int_id: int):
    request = make_request(rid, 4)
    request.sampling_params = dataclasses.replace(request.sampling_params,
                                                  lora_request=LoRARequest(f"l{lora_int_id}", lora_int_id, "/x"))
    return request


def test_lora_unloads_skip_a_step_the_engine_drops_and_count_only_live_requests():
    requests = {"a": _with_adapter("a", 1), "b": _with_adapter("b", 2), "c": make_request("c", 4)}
    requests["b"].status = RequestStatus.FINISHED_ABORTED
    in_flight = [1]
    registry = Registry([2, 3])
    unloads = LoRAUnloads(registry, lambda: in_flight[0])
    idle = SchedulerOutput()
    unloads.attach(idle, requests)  # nothing to do while a step runs: the engine drops it
    assert idle.lora_unloads == [] and registry.in_use is None
    busy = SchedulerOutput([ScheduledChunk("a", 4, 1, True)])
    unloads.attach(busy, requests)
    assert busy.lora_unloads == [2, 3] and registry.in_use == {1}
    registry.retired, in_flight[0] = [4], 0
    unloads.attach(idle, requests)  # nothing in flight: the engine submits it anyway
    assert idle.lora_unloads == [4]
