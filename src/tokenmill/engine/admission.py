"""Admission control: how much work the server holds at once, and the ticket each request carries."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from tokenmill.request import TenantShare

# set by the Batch API and run-batch around their lines' requests (server/batch_lines.py), which post them to the
# server's routes in-process: the engine queues those requests below every interactive one, and preempts them first
batch_work: contextvars.ContextVar[bool] = contextvars.ContextVar("batch_work", default=False)


class UsageListener(Protocol):
    """Hears what each of a client's requests used (server/tenant_limits.py keeps a tenant's budget with it)."""

    def prompt(self, tokens: int) -> None:
        """A request of the client's was admitted with `tokens` prompt tokens."""

    def first_output(self, seconds: float) -> None:
        """Its first output came `seconds` after it arrived."""

    def finished(self, completion_tokens: int, seconds: float) -> None:
        """It ended (finished, failed or aborted) after generating `completion_tokens`, `seconds` after arrival."""


@dataclass(frozen=True)
class Client:
    """Who the requests started in a context are served for: the scheduler shares the engine between clients'
    `share`s, a request's priority is never better (lower) than `priority`, and `usage` hears every request's
    tokens."""

    share: TenantShare
    priority: int = 0
    usage: Optional[UsageListener] = None
    isolate_cache: bool = False  # its requests' prefix-cache blocks are its own (`cache_salt`)

    def isolated_salt(self, requested: Optional[str]) -> str:
        """The cache_salt a request of an `isolate_cache` client runs with: one made of the client's tenant and the
        request's own (`requested`), which no other client's request can give."""
        import hashlib

        return hashlib.sha256(f"{self.share.name}\0{requested or ''}".encode()).hexdigest()


# set by the server's tenant gate around a request's handling (server/tenant_gate.py), and inherited by the work
# that request starts in-process (a batch's lines): None when the server has no tenants
current_client: contextvars.ContextVar[Optional[Client]] = contextvars.ContextVar("current_client", default=None)


@dataclass(frozen=True)
class AdmissionLimits:
    """Bounds on queued work. Past them a request is refused with 429 (and Retry-After), never left to
    wait without bound.

    `max_waiting_requests` and `max_waiting_tokens` bound the scheduler's waiting queue (requests, and
    the prompt tokens they bring; a request is never refused by the token bound when nothing waits, so
    any prompt that fits the model can run). Sequences from arrival to end (prompts x n, tokenising,
    compiling a grammar, waiting or running) are bounded by max_num_seqs + max_waiting_requests.
    """

    max_waiting_requests: int = 256
    max_waiting_tokens: int = 65536
    grammar_compile_timeout: float = 10.0

    def max_sequences(self, max_num_seqs: int) -> int:
        """The most sequences held from arrival to end."""
        return max_num_seqs + self.max_waiting_requests


class Ticket:
    """Admission room held by one request; `release` (idempotent) gives it back. A ticket dropped
    unreleased (a response whose body was never sent) gives it back when collected."""

    def __init__(self, num_sequences: int, release: Callable[[int], None]) -> None:
        self.num_sequences = num_sequences
        self._release = release
        self._held = True

    def release(self) -> None:
        """Give the room back (only the first call counts)."""
        if self._held:
            self._held = False
            self._release(self.num_sequences)

    def __del__(self) -> None:
        self.release()
