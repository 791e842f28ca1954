"""`--kv-transfer-config`: prefill/decode disaggregation on one host, with vLLM's keys.

`{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", "kv_connector_extra_config":
{"shared_storage_path": "/tmp/tokenmill-kv"}}`: a producer (kv_producer or kv_both) writes the KV blocks
of a request that asks `kv_transfer_params: {"do_remote_decode": true}` into that folder; a consumer
(kv_consumer or kv_both) loads them for a request that brings the producer's answer's
`kv_transfer_params` (docs/scale-out.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from tokenmill.kv_events_config import json_object_option

CONNECTORS = ("SharedStorageConnector",)
ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """Which connector, which role, and where the shared files live."""

    kv_connector: str
    kv_role: str
    shared_storage_path: str

    @property
    def produces(self) -> bool:
        """Whether this engine writes blocks for a decode server."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        """Whether this engine loads blocks a prefill server wrote."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: Union[None, str, Mapping[str, Any]]) -> Optional["KVTransferConfig"]:
        """From JSON text or a mapping (None: no transfer); ValueError names what is wrong."""
        if value is None:
            return None
        value = json_object_option(value, "kv_transfer_config", {"kv_connector", "kv_role", "kv_connector_extra_config"})
        connector, role = value.get("kv_connector"), value.get("kv_role", "kv_both")
        if connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {CONNECTORS}, got {connector!r}")
        if role not in ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {ROLES}, got {role!r}")
        extra = value.get("kv_connector_extra_config") or {}
        path = extra.get("shared_storage_path") if isinstance(extra, Mapping) else None
        if not isinstance(path, str) or not path:
            raise ValueError("kv_transfer_config.kv_connector_extra_config.shared_storage_path must name a folder")
        return cls(connector, role, path)
