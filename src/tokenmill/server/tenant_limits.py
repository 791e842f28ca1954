"""A tenant's budget: requests and tokens over the last minute, requests in flight, and the answer to one more.

Windows slide by the second: a window keeps at most 60 one-second totals (bounded whatever the traffic), and a
request refused by a window is told when enough of the window's oldest use will have left it (`Retry-After`).
Tokens are a request's prompt (charged when the engine admits it) and its output (charged when it ends), so
concurrent requests see each other's prompts at once. The clock is injectable: tests move it by hand.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from tokenmill.server.tenants import Tenant

WINDOW_S = 60
RECENT_TTFTS = 64  # the first-token times a budget keeps for the dashboard's median


class SlidingWindow:
    """Amounts added over the last WINDOW_S seconds, in one-second totals."""

    def __init__(self) -> None:
        self._seconds: collections.deque[list[int]] = collections.deque()  # [second, amount], oldest first

    def add(self, amount: int, now: float) -> None:
        """Count `amount` at time `now`."""
        second = int(now)
        self._drop_old(second)
        if self._seconds and self._seconds[-1][0] == second:
            self._seconds[-1][1] += amount
        else:
            self._seconds.append([second, amount])

    def total(self, now: float) -> int:
        """What was added in the window ending at `now`."""
        self._drop_old(int(now))
        return sum(amount for _, amount in self._seconds)

    def seconds_until_below(self, limit: int, now: float) -> float:
        """How long until the window's total is below `limit` with nothing more added (0 when it already is)."""
        total = self.total(now)
        if total < limit:
            return 0.0
        for second, amount in self._seconds:
            total -= amount
            if total < limit:
                return max(0.0, second + WINDOW_S - now)
        return math.inf  # (a limit <= 0)

    def _drop_old(self, second: int) -> None:
        while self._seconds and self._seconds[0][0] <= second - WINDOW_S:
            self._seconds.popleft()


@dataclass(frozen=True)
class Refusal:
    """Why one more request of a tenant is refused now: the limit's name and when to retry (seconds)."""

    limit: str
    retry_after: float

    @property
    def message(self) -> str:
        """The 429's message."""
        return f"this tenant's {self.limit.replace('_', ' ')} limit is reached; retry after {self.retry_s} s"

    @property
    def retry_s(self) -> int:
        """Retry-After in whole seconds (at least 1)."""
        return max(1, math.ceil(self.retry_after))


class TenantBudget:
    """One tenant's use against its limits; also the engine's usage listener for its requests
    (engine/admission.py's Client). Thread-safe: the engine's event loop and the gate both call it."""

    def __init__(self, tenant: Tenant, clock: Callable[[], float] = time.monotonic,
                 observe: Optional[Callable[[str, str, float], None]] = None) -> None:
        self.tenant = tenant
        self.clock = clock
        self.requests, self.tokens = SlidingWindow(), SlidingWindow()
        self.in_flight = 0
        self.recent_ttft: collections.deque[float] = collections.deque(maxlen=RECENT_TTFTS)
        self._lock = threading.Lock()
        self._observe = observe or (lambda tenant, what, value: None)

    def admit(self) -> Optional[Refusal]:
        """Count one more request in flight, or say which limit refuses it."""
        tenant, now = self.tenant, self.clock()
        with self._lock:
            if tenant.max_concurrent is not None and self.in_flight >= tenant.max_concurrent:
                return Refusal("max_concurrent", 1.0)
            if tenant.requests_per_minute is not None and self.requests.total(now) >= tenant.requests_per_minute:
                return Refusal("requests_per_minute", self.requests.seconds_until_below(tenant.requests_per_minute,
                                                                                       now))
            if tenant.tokens_per_minute is not None and self.tokens.total(now) >= tenant.tokens_per_minute:
                return Refusal("tokens_per_minute", self.tokens.seconds_until_below(tenant.tokens_per_minute, now))
            self.requests.add(1, now)
            self.in_flight += 1
            return None

    def release(self) -> None:
        """One request of the tenant's has ended."""
        with self._lock:
            self.in_flight -= 1

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the limits the tenant has."""
        tenant, now = self.tenant, self.clock()
        headers = {}
        with self._lock:
            for kind, window, limit in (("requests", self.requests, tenant.requests_per_minute),
                                        ("tokens", self.tokens, tenant.tokens_per_minute)):
                if limit is None:
                    continue
                used = window.total(now)
                headers[f"x-ratelimit-limit-{kind}"] = str(limit)
                headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, limit - used))
                reset = window.seconds_until_below(limit, now) if used >= limit else _until_empty(window, now)
                headers[f"x-ratelimit-reset-{kind}"] = f"{math.ceil(reset)}s"
        return headers

    # the engine's UsageListener
    def prompt(self, tokens: int) -> None:
        """A request was admitted with `tokens` prompt tokens."""
        with self._lock:
            self.tokens.add(tokens, self.clock())
        self._observe(self.tenant.name, "prompt_tokens", tokens)

    def first_output(self, seconds: float) -> None:
        """A request's first output came `seconds` after it arrived."""
        self.recent_ttft.append(seconds)
        self._observe(self.tenant.name, "ttft", seconds)

    def finished(self, completion_tokens: int, seconds: float) -> None:
        """A request ended having generated `completion_tokens`."""
        with self._lock:
            self.tokens.add(completion_tokens, self.clock())
        self._observe(self.tenant.name, "generation_tokens", completion_tokens)
        self._observe(self.tenant.name, "e2e", seconds)


def _until_empty(window: SlidingWindow, now: float) -> float:
    """Seconds until everything in the window has left it (OpenAI's reset: when the full budget is back)."""
    return window.seconds_until_below(1, now)
