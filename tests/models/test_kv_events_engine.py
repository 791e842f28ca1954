"""KV-cache events of a running engine, received over ZeroMQ as a vLLM-format subscriber receives them."""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec
import pytest
import zmq

from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.core.block_hash import external_hash, none_hash, prompt_block_hashes


# The subscriber's side, written from vLLM's examples/online_serving/kv_events_subscriber.py and
# vllm/distributed/kv_events.py: what a router built for vLLM decodes.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Any]] = None
    group_idx: Optional[int] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
BLOCK = 4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama"))


def receive_all(sub: zmq.Socket) -> list[tuple[bytes, int, bytes]]:
    frames = []
    while sub.poll(500):
        topic, seq, payload = sub.recv_multipart()
        frames.append((topic, int.from_bytes(seq, "big"), payload))
    return frames


def test_events_name_the_prompts_blocks_and_replay_after_reconnecting(model_path, tmp_path):
    endpoint, replay_endpoint = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    llm = LLM(model_path, block_size=BLOCK, num_kv_blocks=10, prefix_caching_hash_seed="router-seed",
              kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint,
                                "replay_endpoint": replay_endpoint, "topic": "kv", "buffer_steps": 1000})
    context = zmq.Context()
    try:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(endpoint)
        sub.poll(300)  # let the subscription reach the publisher
        prompt = list(range(1, 19))  # 4 full blocks and 2 tokens
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        for i in range(3):  # 18 blocks through a pool of 10: the first prompt's blocks are evicted
            llm.generate({"prompt_token_ids": [100 + i] * 21}, params, use_tqdm=False)
        live = receive_all(sub)
        assert live and all(topic == b"kv" for topic, _, _ in live)
        seqs = [seq for _, seq, _ in live]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "sequence numbers are consecutive"
        events = [e for _, _, payload in live for e in DECODER.decode(payload).events]

        stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
        removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        expected = [external_hash(h) for h in prompt_block_hashes(none_hash("router-seed"), prompt, BLOCK)]
        assert stored[:len(expected)] == expected  # the prompt's 4 full blocks, the parents chained
        assert set(expected) <= set(removed)  # the flood evicted them
        first = next(e for e in events if isinstance(e, BlockStored))
        assert first.parent_block_hash is None and first.token_ids == prompt[:len(first.block_hashes) * BLOCK]
        assert first.block_size == BLOCK and first.medium == "CPU"

        # A subscriber that (re)connects asks the replay socket for everything from sequence 0.
        # (A DEALER: a REQ socket would take only the first of the replies.)
        replay = context.socket(zmq.DEALER)
        replay.connect(replay_endpoint)
        replay.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while replay.poll(2000):
            _, topic, seq, payload = replay.recv_multipart()
            if not payload:
                assert int.from_bytes(seq, "big", signed=True) == -1
                break
            replayed.append((topic, int.from_bytes(seq, "big"), payload))
        assert replayed[0][1] == 0 and isinstance(DECODER.decode(replayed[0][2]).events[0], AllBlocksCleared)
        assert replayed[-len(live):] == live, "the replay resends exactly what was published"
    finally:
        context.destroy(linger=0)
        llm.llm_engine.shutdown()


def test_a_taken_endpoint_is_refused_by_name(model_path, tmp_path):
    context = zmq.Context()
    holder = context.socket(zmq.PUB)
    holder.bind("tcp://127.0.0.1:*")
    port = holder.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    try:
        with pytest.raises(ValueError, match="kv_events_config: cannot open tcp://\\*:" + port):
            LLM(model_path, num_kv_blocks=8, kv_events_config={"enable_kv_cache_events": True,
                                                               "endpoint": f"tcp://*:{port}"})
    finally:
        context.destroy(linger=0)
