"""`--kv-events-config`: where and how KV-cache events are published, with vLLM's keys and defaults."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig: events are published when `enable_kv_cache_events` and publisher is zmq.

    `endpoint` is a ZeroMQ PUB address (bound when it has a wildcard host or is ipc://, else connected);
    `replay_endpoint` a ROUTER address that resends buffered batches from a sequence number;
    `buffer_steps` batches are kept for replay; `hwm` is the PUB socket's high-water mark; at most
    `max_queue_size` batches wait for the publishing thread (newer ones are dropped and counted past it).
    """

    enable_kv_cache_events: bool = False
    publisher: Optional[str] = None  # None: zmq when enabled, else null
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def active(self) -> bool:
        """Whether events are published."""
        return self.enable_kv_cache_events and self.resolved_publisher == "zmq"

    @property
    def resolved_publisher(self) -> str:
        """The publisher after resolving the default."""
        if self.publisher is None:
            return "zmq" if self.enable_kv_cache_events else "null"
        return self.publisher

    @classmethod
    def parse(cls, value: Union[None, str, Mapping[str, Any]]) -> "KVEventsConfig":
        """From JSON text or a mapping (None: disabled); ValueError names what is wrong."""
        if value is None:
            return cls()
        value = json_object_option(value, "kv_events_config", {f.name for f in dataclasses.fields(cls)})
        config = cls(**value)
        config._check()
        return config

    def _check(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events must be true or false")
        if self.publisher is not None and self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {PUBLISHERS}, got {self.publisher!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config.{name} must be a string")
        for name, endpoint in (("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)):
            if endpoint is not None and (not isinstance(endpoint, str)
                                         or not endpoint.startswith(("tcp://", "ipc://", "inproc://"))):
                raise ValueError(f"kv_events_config.{name} must be a tcp://, ipc:// or inproc:// address, "
                                 f"got {endpoint!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            number = getattr(self, name)
            if not isinstance(number, int) or isinstance(number, bool) or number < 1:
                raise ValueError(f"kv_events_config.{name} must be an integer >= 1, got {number!r}")

    def for_rank(self, rank: int) -> "KVEventsConfig":
        """The config of data-parallel replica `rank`: tcp ports offset by the rank, as vLLM does, and
        ipc/inproc addresses suffixed `_dp<rank>`."""
        if rank == 0:
            return self
        return dataclasses.replace(self, endpoint=offset_endpoint(self.endpoint, rank),
                                   replay_endpoint=offset_endpoint(self.replay_endpoint, rank))


def json_object_option(value: Union[str, Mapping[str, Any]], name: str, known: set[str]) -> Mapping[str, Any]:
    """A JSON-object option (`--kv-events-config`, `--kv-transfer-config`) given as text or a mapping,
    as a mapping with only `known` keys; ValueError naming the option and what is wrong."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}; known: {sorted(known)}")
    return value


def offset_endpoint(endpoint: Optional[str], rank: int) -> Optional[str]:
    """`endpoint` for data-parallel rank `rank`."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if port == "0" else f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"
