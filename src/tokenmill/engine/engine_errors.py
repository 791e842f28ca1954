"""What the engine behind the server raises to its callers (the server maps each to an HTTP status)."""

from __future__ import annotations


class QueueFullError(RuntimeError):
    """The server is at its admission limit; the client should retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped or is shutting down; no request can run (HTTP 503)."""


class RequestFailedError(RuntimeError):
    """This request's own work failed inside an engine step; other requests were not affected."""


class WeightTransferError(RuntimeError):
    """A trainer's weight-update group could not be joined or its transfer broke; the served weights are unchanged
    (HTTP 502: the failure is the trainer's side of the transfer)."""
