"""KV-cache events published over ZeroMQ in vLLM's wire format, for prefix-aware routers.

Each engine step's events form one `KVEventBatch`, encoded with msgspec's MessagePack encoder and
sent on a PUB socket as three frames: topic, sequence number (8 bytes, big-endian, from 0), payload.
The last `buffer_steps` batches are kept: a subscriber that missed some sends the first sequence it
wants (8 bytes, big-endian) to the ROUTER replay socket and gets every buffered batch from there on as
(topic, sequence, payload) frames, then an end marker (empty topic, sequence -1, empty payload).
The message types mirror vllm/distributed/kv_events.py (vLLM 0.32), field for field.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from itertools import count
from typing import Any, Optional, Union

import msgspec
import zmq

from tokenmill.core.block_hash import external_hash
from tokenmill.core.kv_events import AllBlocksCleared as AllCleared
from tokenmill.core.kv_events import BlocksRemoved, BlocksStored, KVEvent
from tokenmill.kv_events_config import KVEventsConfig

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STARTUP_TIMEOUT_S = 10.0


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's events: [ts, events, data_parallel_rank]."""

    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the event types; each is encoded as a map tagged with its class name under "type"."""


class BlockStored(KVCacheEvent):
    """Consecutive full blocks became findable; `token_ids` holds all their tokens."""

    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None


class BlockRemoved(KVCacheEvent):
    """Blocks were evicted."""

    block_hashes: list[int]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(KVCacheEvent):
    """Every block is gone."""


class KVEventBatch(EventBatch):
    """A batch of the three event types (what subscribers decode)."""

    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


def to_wire(events: list[KVEvent], block_size: int, medium: str, grouped: bool) -> list[KVCacheEvent]:
    """The engine's event records as vLLM's event types (`grouped`: say each event's KV cache group)."""
    wire: list[KVCacheEvent] = []
    for event in events:
        group = event.group if grouped and not isinstance(event, AllCleared) else None
        if isinstance(event, BlocksStored):
            extra = [None if keys is None else tuple(value for _, value in keys) for keys in event.extra_keys]
            wire.append(BlockStored([external_hash(h) for h in event.hashes],
                                    external_hash(event.parent) if event.parent is not None else None,
                                    event.token_ids, block_size, None, medium, None,
                                    extra if any(k is not None for k in extra) else None, group))
        elif isinstance(event, BlocksRemoved):
            wire.append(BlockRemoved([external_hash(h) for h in event.hashes], medium, group))
        else:
            wire.append(AllBlocksCleared())
    return wire


class ZmqEventPublisher:
    """Publishes event batches from a thread of its own, which owns both sockets.

    Invariants: at most `max_queue_size` batches wait (newer ones are dropped and counted in
    `num_dropped`, and subscribers see the gap in sequence numbers); sequence numbers are consecutive
    over the batches sent.
    """

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.num_dropped = 0
        self._queue: queue.Queue[Optional[EventBatch]] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        if not self._ready.wait(_STARTUP_TIMEOUT_S):
            raise RuntimeError("the KV event publisher did not start")
        if self._error is not None:
            raise ValueError(f"kv_events_config: cannot open {config.endpoint}"
                             f"{' / ' + config.replay_endpoint if config.replay_endpoint else ''}: "
                             f"{self._error}") from self._error

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one batch; dropped (and counted) when the queue is full."""
        batch = EventBatch(time.time(), events, self.data_parallel_rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning("KV event queue full: %d batches dropped so far", self.num_dropped)

    def shutdown(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to `timeout` seconds), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def _open(self, context: zmq.Context) -> tuple[zmq.Socket, Optional[zmq.Socket]]:
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.config.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        endpoint = self.config.endpoint
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            pub.bind(endpoint)
        else:
            pub.connect(endpoint)
        replay = None
        if self.config.replay_endpoint:
            replay = context.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(self.config.replay_endpoint)
        return pub, replay

    def _run(self) -> None:
        context = zmq.Context()
        try:
            pub, replay = self._open(context)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            context.term()
            return
        self._ready.set()
        encoder = msgspec.msgpack.Encoder()
        sequence = count()
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay)
                try:
                    batch = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if batch is None:
                    break
                seq, payload = next(sequence), encoder.encode(batch)
                pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
        except Exception:
            logger.exception("the KV event publisher stopped")
        finally:
            pub.close()
            if replay is not None:
                replay.close()
            context.term()

    def _serve_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))
