"""The engine's step log and request timeline (engine/telemetry.py): what is recorded, when, and its bounds."""

from __future__ import annotations

from tokenmill.engine.telemetry import DECODE, PREFILL, ChunkInfo, Telemetry


def chunk(request_id: str, kind: str, tokens: int = 1, preemptions: int = 0, samples: bool = False) -> ChunkInfo:
    return ChunkInfo(request_id, tokens, kind, preemptions, arrival=0.0, samples=samples or kind == DECODE)


def test_steps_are_always_logged_and_split_into_prefill_and_decode():
    telemetry = Telemetry(max_steps=3)
    for i in range(5):
        telemetry.record_step(float(i), [chunk("a", PREFILL, 16), chunk("b", DECODE, 3)], ended=i + 0.5)
    assert [s.seq for s in telemetry.steps] == [3, 4, 5]  # bounded: the oldest go
    last = telemetry.steps[-1]
    assert (last.prefill_tokens, last.decode_tokens, last.num_requests, last.duration) == (16, 3, 2, 0.5)
    assert (telemetry.prefill_tokens_total, telemetry.decode_tokens_total) == (80, 15)
    assert [s.seq for s in telemetry.steps_after(3)] == [4, 5] and telemetry.steps_after(5) == []
    assert not telemetry.active, "nobody watches: no timeline"
    assert telemetry.record_step(9.0, [], ended=9.5) is None and telemetry.steps[-1].seq == 5  # computed nothing


def test_a_watched_request_gets_prefill_chunks_merged_decode_runs_and_preemptions():
    telemetry = Telemetry()
    telemetry.watchers = 1
    telemetry.record_step(1.0, [chunk("a", PREFILL, 32)], ended=1.5)
    telemetry.record_step(2.0, [chunk("a", PREFILL, 8, samples=True)], ended=2.5)  # the prompt's end: a token
    for t in (3.0, 4.0, 5.0):
        telemetry.record_step(t, [chunk("a", DECODE)], ended=t + 0.5)
    telemetry.record_step(7.0, [chunk("a", PREFILL, 43, preemptions=1, samples=True)], ended=7.5)  # recomputed
    telemetry.record_step(8.0, [chunk("a", DECODE, preemptions=1)], ended=8.5)
    trace = telemetry.active["a"]
    assert trace.first_scheduled == 1.0 and trace.first_token == 2.5 and trace.preemptions == [7.0]
    assert trace.spans == [[PREFILL, 1.0, 1.5, 32], [PREFILL, 2.0, 2.5, 8], [DECODE, 3.0, 5.5, 3],
                           [PREFILL, 7.0, 7.5, 43], [DECODE, 8.0, 8.5, 1]]
    telemetry.record_finished("a", "length", output_tokens=6)
    assert not telemetry.active
    assert (telemetry.traces()[0].finish_reason, telemetry.traces()[0].output_tokens) == ("length", 6)


def test_the_timeline_is_bounded_and_stops_with_the_last_watcher():
    telemetry = Telemetry(max_requests=2, max_spans=3)
    telemetry.watchers = 1
    for i in range(5):
        telemetry.record_step(float(i), [chunk("long", PREFILL, 4)], ended=i + 0.5)
    assert [span[1] for span in telemetry.active["long"].spans] == [2.0, 3.0, 4.0]
    for name in ("x", "y", "z"):
        telemetry.record_step(9.0, [chunk(name, PREFILL)], ended=9.5)
        telemetry.record_finished(name, "stop")
    assert [t.request_id for t in telemetry.traces()] == ["y", "z", "long"]
    telemetry.record_finished("never-scheduled", "abort", arrival=9.0)  # aborted while queued, while watched
    assert telemetry.traces()[-2].request_id == "never-scheduled"
    telemetry.watchers = 0
    telemetry.stop_tracing()
    telemetry.record_step(10.0, [chunk("late", DECODE)], ended=10.5)
    telemetry.record_finished("late", "stop", arrival=9.0)
    assert "late" not in {t.request_id for t in telemetry.traces()} and not telemetry.active
