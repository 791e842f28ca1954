"""A request's outputs on their way from the engine thread to the event loop (`AsyncEngine`)."""

from __future__ import annotations

import asyncio
import collections

from tokenmill.outputs import RequestOutput, merge_outputs

# Outputs a stream holds for a slow reader; past it the newest output is merged into the last queued
# one (`merge_outputs`: nothing is lost, and a slow reader costs at most its request's output in memory).
MAX_PENDING_OUTPUTS = 8


class OutputStream:
    """One request's outputs on their way to the event loop: at most MAX_PENDING_OUTPUTS queued.

    Only the event loop's thread calls `put` and `get`.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: collections.deque = collections.deque()
        self._ready = asyncio.Event()

    def put(self, item: "RequestOutput | BaseException") -> None:
        """Queue an output (replacing the newest queued one when full) or an error that ends the stream."""
        if (isinstance(item, RequestOutput) and len(self._items) >= MAX_PENDING_OUTPUTS
                and isinstance(self._items[-1], RequestOutput)):
            self._items[-1] = merge_outputs(self._items[-1], item)
        else:
            self._items.append(item)
        self._ready.set()

    async def get(self) -> "RequestOutput | BaseException":
        """The next item, waiting for one."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)


def deliver(items: list[tuple[OutputStream, "RequestOutput | BaseException"]]) -> None:
    """On the event loop: hand each item to its stream, in the order the step produced them."""
    for stream, item in items:
        stream.put(item)
