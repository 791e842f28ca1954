"""The KV connector seam: a step's copies, phase by phase and connector by connector (core/kv_connector.py,
worker/kv_connectors.py)."""

from __future__ import annotations

import pytest

from tokenmill.core.kv_connector import KVCopies
from tokenmill.worker.kv_connectors import KVConnectorWorker, run_phase


class Recorder(KVConnectorWorker):
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def copy_out(self, pages, entries):
        self.calls.append((self.name, "out", entries))

    def copy_in(self, pages, entries):
        self.calls.append((self.name, "into", entries))

    def copy_after(self, pages, entries):
        self.calls.append((self.name, "after", entries))


def test_every_connector_copies_out_then_into_then_after():
    calls = []
    workers = {name: Recorder(name, calls) for name in ("transfer", "tier", "swap")}
    step = [KVCopies("transfer", into=["import"], after=["export"]),
            KVCopies("tier", out=[(1, 0)], into=[(0, 2)]),
            KVCopies("swap", out=[(3, 1)], into=[(1, 4)])]
    for phase in ("out", "into", "after"):
        run_phase(workers, [], step, phase)
    # every save out of the pool before any load into it: a load may write a block a save still reads
    assert calls == [("tier", "out", [(1, 0)]), ("swap", "out", [(3, 1)]), ("transfer", "into", ["import"]),
                     ("tier", "into", [(0, 2)]), ("swap", "into", [(1, 4)]), ("transfer", "after", ["export"])]


def test_copies_for_a_store_the_runner_lacks_fail_by_name():
    with pytest.raises(RuntimeError, match="swap copies were scheduled, but this runner has no swap store"):
        run_phase({}, [], [KVCopies("swap", out=[(0, 0)])], "out")
    run_phase({}, [], [KVCopies("swap", into=[(0, 0)])], "out")  # nothing of this phase: nothing to do


def test_the_scheduler_orders_its_connectors_and_hands_over_only_nonempty_copies():
    from fake_runner import make_request, make_scheduler

    scheduler, runner = make_scheduler(block_size=4, budget=64)
    assert [c.name for c in scheduler.connectors] == ["transfer"]  # no tier, no swap space configured
    scheduler.add_request(make_request("a", 10, max_tokens=2))
    schedule = scheduler.schedule()
    assert schedule.kv_copies == [] and schedule.copies("transfer") is None
