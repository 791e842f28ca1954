"""Which replica holds which prefix blocks, learned from each replica's KV-cache events.

One thread subscribes to every replica's event stream (engine/kv_event_publisher.py). A gap in a
replica's sequence numbers, or a first message that is not its sequence 0, is filled from that
replica's replay socket, so the index survives a lost message or a late start; a sequence number
that goes backwards means the replica restarted, and its set is rebuilt from what follows.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import msgspec
import zmq

from tokenmill.engine.kv_event_publisher import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

logger = logging.getLogger(__name__)

_REPLAY_TIMEOUT_MS = 1000


@dataclass(frozen=True)
class EventSource:
    """Where one replica publishes: its PUB address, its replay address (or None) and topic."""

    endpoint: str
    replay_endpoint: Optional[str]
    topic: str = ""


class PrefixIndex:
    """Per replica, the external hashes of the group-0 blocks it can hit; `matched_blocks` answers lookups.

    Invariant: `_blocks[r]` is the result of applying replica r's events in sequence order, with none
    missing since its last AllBlocksCleared or restart (else it is rebuilt from the replay buffer).
    """

    def __init__(self, sources: Sequence[EventSource]) -> None:
        self.sources = list(sources)
        self._blocks: list[set[int]] = [set() for _ in sources]
        self._last_seq: list[int] = [-1] * len(sources)
        self._lock = threading.Lock()
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._stop = threading.Event()
        self.num_replays = 0
        self._thread = threading.Thread(target=self._run, name="prefix-index", daemon=True)
        self._thread.start()

    def matched_blocks(self, replica: int, hashes: Sequence[int]) -> int:
        """How many of the leading `hashes` (a prompt's block chain) replica `replica` holds in a row."""
        with self._lock:
            held = self._blocks[replica]
            count = 0
            for block in hashes:
                if block not in held:
                    break
                count += 1
            return count

    def num_blocks(self, replica: int) -> int:
        """Blocks the index believes replica `replica` holds."""
        with self._lock:
            return len(self._blocks[replica])

    def forget(self, replica: int) -> None:
        """Replica `replica` went away: it holds nothing until its events say otherwise."""
        with self._lock:
            self._blocks[replica].clear()
            self._last_seq[replica] = -1

    def close(self) -> None:
        """Stop the subscriber thread."""
        self._stop.set()
        self._thread.join(2.0)

    def apply(self, replica: int, seq: int, batch: KVEventBatch) -> None:
        """Apply one batch of replica `replica`'s events (sequence `seq`)."""
        with self._lock:
            if seq <= self._last_seq[replica]:
                return  # already applied (a replay overlapping what arrived live)
            self._last_seq[replica] = seq
            held = self._blocks[replica]
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    held.clear()
                elif event.group_idx not in (None, 0):
                    continue
                elif isinstance(event, BlockStored):
                    held.update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    held.difference_update(event.block_hashes)

    def _run(self) -> None:
        context = zmq.Context()
        subs = []
        poller = zmq.Poller()
        for source in self.sources:
            sub = context.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(source.endpoint)
            poller.register(sub, zmq.POLLIN)
            subs.append(sub)
        try:
            while not self._stop.is_set():
                for sub, _ in poller.poll(100):
                    replica = subs.index(sub)
                    _, seq_bytes, payload = sub.recv_multipart()
                    seq = int.from_bytes(seq_bytes, "big")
                    if seq <= self._last_seq[replica]:  # live batches come in order: the replica restarted
                        self.forget(replica)
                    if seq > self._last_seq[replica] + 1:
                        self._replay(context, replica, self._last_seq[replica] + 1)
                    self._decode_and_apply(replica, seq, payload)
        except Exception:
            logger.exception("the prefix index stopped: requests are balanced on load alone")
        finally:
            context.destroy(linger=0)

    def _decode_and_apply(self, replica: int, seq: int, payload: bytes) -> None:
        try:
            batch = self._decoder.decode(payload)
        except msgspec.DecodeError:
            logger.warning("replica %d sent an undecodable KV event batch (sequence %d)", replica, seq)
            return
        self.apply(replica, seq, batch)

    def _replay(self, context: zmq.Context, replica: int, first: int) -> None:
        """Fetch replica `replica`'s buffered batches from sequence `first` on."""
        endpoint = self.sources[replica].replay_endpoint
        if endpoint is None:
            return
        self.num_replays += 1
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        try:
            dealer.send_multipart((b"", first.to_bytes(8, "big")))
            while dealer.poll(_REPLAY_TIMEOUT_MS):
                _, _, seq_bytes, payload = dealer.recv_multipart()
                if not payload:
                    break
                self._decode_and_apply(replica, int.from_bytes(seq_bytes, "big"), payload)
        finally:
            dealer.close()
