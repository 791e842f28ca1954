"""`--kv-transfer-config`: prefill/decode disaggregation, with vLLM's keys.

- `SharedStorageConnector` (one host): `{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
  "kv_connector_extra_config": {"shared_storage_path": "/tmp/tokenmill-kv"}}`. A producer (kv_producer
  or kv_both) writes the KV blocks of a request that asks `kv_transfer_params: {"do_remote_decode": true}`
  into that folder; a consumer (kv_consumer or kv_both) loads them for a request that brings the
  producer's answer's `kv_transfer_params`.
- `TCPConnector` (across hosts): `{"kv_connector": "TCPConnector", "kv_role": "kv_producer", "kv_ip":
  "0.0.0.0", "kv_port": 14579}`. The producer keeps each finished prompt's blocks in its own spool
  folder and serves them on kv_ip:kv_port; the consumer fetches them from the host and port the
  producer's answer names (engine/kv_transfer_tcp.py). Extra keys: `shared_storage_path` (the spool
  folder; default: a fresh temporary one), `advertise_host` (the host name the producer's answers give;
  default kv_ip, or this machine's name when kv_ip is a wildcard) and `fetch_timeout_s` (the most a
  consumer waits for one transfer, default 10).

docs/scale-out.md says how the two servers and a proxy work together.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from tokenmill.kv_events_config import json_object_option

SHARED_STORAGE, TCP = "SharedStorageConnector", "TCPConnector"
CONNECTORS = (SHARED_STORAGE, TCP)
ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_KV_PORT = 14579  # vLLM's default kv_port
_EXTRA = {SHARED_STORAGE: {"shared_storage_path"},
          TCP: {"shared_storage_path", "advertise_host", "fetch_timeout_s"}}


@dataclass(frozen=True)
class KVTransferConfig:
    """Which connector, which role, where the blocks wait, and (TCP) where the producer listens."""

    kv_connector: str
    kv_role: str
    shared_storage_path: Optional[str]  # None (TCP only): a fresh temporary folder
    kv_ip: str = "127.0.0.1"
    kv_port: int = DEFAULT_KV_PORT  # 0: any free port (tests)
    advertise_host: Optional[str] = None
    fetch_timeout_s: float = 10.0

    @property
    def produces(self) -> bool:
        """Whether this engine writes blocks for a decode server."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        """Whether this engine loads blocks a prefill server wrote."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def over_tcp(self) -> bool:
        """Whether blocks travel over TCP (else through the shared folder)."""
        return self.kv_connector == TCP

    @property
    def public_host(self) -> str:
        """The host a decode server connects to, as the producer's answers name it."""
        if self.advertise_host:
            return self.advertise_host
        return socket.getfqdn() if self.kv_ip in ("0.0.0.0", "::", "") else self.kv_ip

    @classmethod
    def parse(cls, value: Union[None, str, Mapping[str, Any]]) -> Optional["KVTransferConfig"]:
        """From JSON text or a mapping (None: no transfer); ValueError names what is wrong."""
        if value is None:
            return None
        value = json_object_option(value, "kv_transfer_config",
                                   {"kv_connector", "kv_role", "kv_connector_extra_config", "kv_ip", "kv_port"})
        connector, role = value.get("kv_connector"), value.get("kv_role", "kv_both")
        if connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {CONNECTORS}, got {connector!r}")
        if role not in ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {ROLES}, got {role!r}")
        extra = value.get("kv_connector_extra_config") or {}
        if not isinstance(extra, Mapping):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a JSON object")
        unknown = sorted(set(extra) - _EXTRA[connector])
        if unknown:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config has keys {unknown} that {connector} "
                             f"does not take; it takes {sorted(_EXTRA[connector])}")
        path = extra.get("shared_storage_path")
        if not (isinstance(path, str) and path) and not (connector == TCP and path is None):
            raise ValueError("kv_transfer_config.kv_connector_extra_config.shared_storage_path must name a folder")
        if connector == SHARED_STORAGE:
            if "kv_ip" in value or "kv_port" in value:
                raise ValueError("kv_transfer_config: kv_ip and kv_port are TCPConnector's; "
                                 "SharedStorageConnector moves blocks through shared_storage_path")
            return cls(connector, role, path)
        ip, port = value.get("kv_ip", "127.0.0.1"), value.get("kv_port", DEFAULT_KV_PORT)
        if not isinstance(ip, str) or not ip:
            raise ValueError(f"kv_transfer_config.kv_ip must be an address to listen on, got {ip!r}")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"kv_transfer_config.kv_port must be a port number (0-65535), got {port!r}")
        host, timeout = extra.get("advertise_host"), extra.get("fetch_timeout_s", 10.0)
        if host is not None and (not isinstance(host, str) or not host):
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config.advertise_host must be a host "
                             f"name, got {host!r}")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= 600:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config.fetch_timeout_s must be a number "
                             f"of seconds in (0, 600], got {timeout!r}")
        return cls(connector, role, path, ip, port, host, float(timeout))
