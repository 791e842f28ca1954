"""`tokenmill serve --data-parallel-size 2`: one port, two replicas; requests sharing a prefix go to the
replica that caches it, load spreads over both, and a killed replica stops getting requests at once
while its in-flight requests end cleanly or are answered by the other — then comes back."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest

from e2e.server_harness import ServerProcess, metric, metric_samples, sse_events, wait_for_metrics
from helpers.tiny_models import make_tiny_hf_model

PREFIX = list(range(10, 50))  # 40 tokens: 10 blocks of 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama"))


@pytest.fixture(scope="module")
def front(tiny, tmp_path_factory):
    # a KV pool per replica that holds its longest load (4 streams of up to 409 tokens, in blocks of 4) without
    # preempting, with room to spare: a pool sized from memory costs each replica seconds to start
    server = ServerProcess(tiny, "--data-parallel-size", "2", "--block-size", "4", "--max-num-seqs", "4",
                           "--num-kv-blocks", "1100", "--served-model-name", "m",
                           log_path=tmp_path_factory.mktemp("dp") / "dp.log").start()
    try:
        server.wait_ready()
        wait_for_metrics(server.url, lambda s: all(metric(s, "tokenmill_dp_replica_up", engine=r) == 1
                                                    for r in "01"), timeout=120)
        yield server
    finally:
        server.stop()


def complete(url: str, prompt: list[int], max_tokens: int = 4, **extra) -> dict:
    response = httpx.post(f"{url}/v1/completions", timeout=60, json=dict(
        model="m", prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, **extra))
    assert response.status_code == 200, response.text
    return response.json()


def routed(url: str) -> dict[str, float]:
    samples = metric_samples(url)
    return {r: metric(samples, "tokenmill_dp_requests_routed_total", engine=r) for r in "01"}


def replica_pids(front_pid: int) -> dict[int, int]:
    """rank -> pid of the front's replica processes."""
    pids = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{entry}/stat").read()
            argv = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == front_pid:
            rank = argv[argv.index(b"--data-parallel-rank") + 1] if b"--data-parallel-rank" in argv else b"0"
            pids[int(rank)] = int(entry)
    return pids


def test_requests_sharing_a_prefix_go_to_the_replica_that_caches_it(front):
    before = routed(front.url)
    first = complete(front.url, PREFIX + [1])
    after_first = routed(front.url)
    holder = next(r for r in "01" if after_first[r] > before[r])
    # the holder's KV events reach the front's prefix index
    wait_for_metrics(front.url, lambda s: metric(s, "tokenmill_dp_prefix_index_blocks", engine=holder) > 0, timeout=60)
    for question in range(2, 6):
        answer = complete(front.url, PREFIX + [question, question])
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PREFIX)
    after = routed(front.url)
    assert after[holder] - after_first[holder] == 4, f"repeated-prefix requests left replica {holder}: {after}"
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    samples = metric_samples(front.url)
    assert metric(samples, "tokenmill_dp_prefix_matched_tokens_total", engine=holder) >= 4 * len(PREFIX)
    # the replicas' own series come through the front, labelled by engine
    assert metric(samples, "vllm:num_requests_running", engine=holder) == 0


def test_concurrent_requests_without_a_shared_prefix_use_both_replicas(front):
    before = routed(front.url)
    threads = [threading.Thread(target=complete, args=(front.url, [200 + i] * 12, 48)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    after = routed(front.url)
    assert all(after[r] > before[r] for r in "01"), f"one replica took every request: {before} -> {after}"


def test_a_killed_replica_stops_getting_requests_and_its_requests_end_cleanly(front):
    """The replica is killed as soon as every stream has its first event (its pid looked up before they start):
    400 tokens leave each stream hundreds of steps to go then, and the test fails if no stream was cut."""
    reference = complete(front.url, [7] * 9, max_tokens=24)["choices"][0]["text"]
    streams: list[list[str]] = []
    answers: list[dict] = []
    started = threading.Semaphore(0)

    def stream(i: int) -> None:
        with httpx.stream("POST", f"{front.url}/v1/completions", timeout=60, json=dict(
                model="m", prompt=[300 + i] * 9, max_tokens=400, temperature=0, ignore_eos=True,
                stream=True)) as r:
            lines = r.iter_lines()
            first = [next(lines)]
            started.release()
            streams.append(sse_events(first + list(lines)))

    def whole() -> None:
        answers.append(complete(front.url, [7] * 9, max_tokens=24))

    victim = replica_pids(front.proc.pid)[1]
    workers = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for worker in workers:
        worker.start()
    for _ in workers:
        assert started.acquire(timeout=30)  # every stream is under way
    os.kill(victim, signal.SIGKILL)
    late = [threading.Thread(target=whole) for _ in range(4)]
    for worker in late:
        worker.start()
    # the front learns of the death from the replica's process ending, not from a health check on a timer;
    # the generous bound only keeps a broken front from hanging the test on a loaded machine
    wait_for_metrics(front.url, lambda s: metric(s, "tokenmill_dp_replica_up", engine="1") == 0, timeout=60)
    for worker in late:  # a late request that met the dead replica is routed again: done before the count
        worker.join(60)
    before = routed(front.url)
    for i in range(3):  # at once, long before the dead replica can be back
        complete(front.url, [400 + i] * 6)
    after = routed(front.url)
    for worker in workers + late:
        worker.join(60)
    assert len(streams) == 4 and len(answers) == 4
    failed = [events for events in streams if any('"error"' in e for e in events)]
    assert failed, "no stream was on the killed replica"
    for events in streams:
        assert events[-1] == "[DONE]"  # every stream ends, with an error event or its whole answer
    assert all(a["choices"][0]["text"] == reference for a in answers)  # retried or not, the same answer
    assert after["1"] == before["1"] and after["0"] == before["0"] + 3
    assert httpx.get(f"{front.url}/health").status_code == 200  # one replica is still up


def test_a_replica_that_died_is_started_again_and_takes_requests(front):
    """(After the test above killed replica 1.)"""
    samples = wait_for_metrics(front.url, lambda s: metric(s, "tokenmill_dp_replica_up", engine="1") == 1,
                               timeout=120)
    assert metric(samples, "tokenmill_dp_replica_restarts_total", engine="1") == 1
    test_concurrent_requests_without_a_shared_prefix_use_both_replicas(front)


def test_stored_responses_are_continued_read_and_deleted_on_the_replica_that_made_them(front):
    from concurrent.futures import ThreadPoolExecutor

    import openai

    client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="none", max_retries=0)
    before = routed(front.url)

    def make(i: int) -> str:
        ask = dict(model="m", input=f"Story number {i}:", max_output_tokens=24, temperature=0)
        if i % 2:  # streamed: the id comes in the first event
            return list(client.responses.create(stream=True, **ask))[0].response.id
        return client.responses.create(**ask).id

    with ThreadPoolExecutor(max_workers=8) as pool:  # at once: both replicas make some
        ids = list(pool.map(make, range(8)))
    after = routed(front.url)
    assert all(after[r] > before[r] for r in "01"), (before, after)
    for response_id in ids:
        assert client.responses.retrieve(response_id).id == response_id
        follow = client.responses.create(model="m", previous_response_id=response_id, input="And then?",
                                         max_output_tokens=2, temperature=0)
        assert follow.previous_response_id == response_id
    client.responses.delete(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
