"""Prefill/decode disaggregation: through shared files (vLLM's SharedStorageConnector, on one host) or
over TCP (TCPConnector, across hosts: engine/kv_transfer_tcp.py carries the same files between spools).

A producer runs a request that asks `kv_transfer_params: {"do_remote_decode": true}`; the runner writes
the K/V of the prompt's full blocks (those before its last token) to `<folder>/<id>.kv` after the step
that completes the prompt (worker/kv_transfer_io.py). When the request ends, the engine writes
`<id>.json` beside it — the model's fingerprint, the block size, the blocks' hashes, the file's length
and CRC-32 — and answers `kv_transfer_params: {"do_remote_prefill": true, "remote_kv_path": ...}`.

A consumer given those params checks the description against its own model and against the hashes of
its request's own prompt, and the data against the length and CRC-32, then adopts the blocks into its
prefix cache (core/kv_transfer_connector.py): the request runs as a prefix-cache hit, computing only the last
prompt token and what follows, so its output is the single engine's. Any check that fails leaves the
request to prefill locally (and says why in the log); a transfer never changes an answer.

Over TCP the producer's answer names its host, port and the transfer's id instead of a path; the
consumer first fetches the transfer into its own spool folder (`fetch`, off the engine thread when
served), then checks and adopts it as a shared file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
import zlib
from typing import Any, Optional

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.engine.kv_transfer_tcp import TransferRefused, TransferServer, fetch_transfer
from tokenmill.kv_transfer_config import KVTransferConfig
from tokenmill.request import Request

logger = logging.getLogger(__name__)

_VERSION = 1
_STALE_S = 600.0  # a file no decode server took within this long is removed by its producer


_WEIGHT_SUFFIXES = (".json", ".safetensors", ".gguf", ".bin", ".pt")
_SAMPLE = 1 << 20


def model_identity(path: str) -> str:
    """A digest that tells one model's weights from another's wherever they lie: for the model file, or
    each config and weight file of the model folder, its name (in a folder), its length, and its first and
    last MiB. Two hosts that hold the same files get the same digest whatever their paths."""
    digest = hashlib.sha256()
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, name) for name in os.listdir(path) if name.endswith(_WEIGHT_SUFFIXES))
    for name in files:
        size = os.path.getsize(name)
        digest.update(f"{os.path.basename(name) if name != path else ''}:{size}:".encode())
        with open(name, "rb") as handle:
            digest.update(handle.read(_SAMPLE))
            if size > 2 * _SAMPLE:
                handle.seek(size - _SAMPLE)
                digest.update(handle.read(_SAMPLE))
    return digest.hexdigest()


class KVTransfers:
    """The engine's side of transfers: file names, descriptions, and the checks before adoption."""

    def __init__(self, config: KVTransferConfig, fingerprint: dict[str, Any], kv_cache: KVCacheManager) -> None:
        self.config = config
        self.fingerprint = fingerprint
        self.kv_cache = kv_cache
        self._own_spool = config.shared_storage_path is None
        self.folder = tempfile.mkdtemp(prefix="tokenmill-kv-") if self._own_spool else config.shared_storage_path
        os.makedirs(self.folder, exist_ok=True)
        self.num_imported = self.num_refused = 0
        self._count_lock = threading.Lock()  # fetches refuse on other threads
        self.server: Optional[TransferServer] = None
        self._served_at: dict[str, Any] = {}  # where answers send decode servers (the host is resolved once)
        if config.over_tcp and config.produces:
            self.server = TransferServer(self.folder, config.kv_ip, config.kv_port)
            self._served_at = {"remote_host": config.public_host, "remote_port": self.server.port}
            logger.info("KV transfers served on %s:%d (answers name %s)", config.kv_ip, self.server.port,
                        self._served_at["remote_host"])

    def close(self) -> None:
        """Stop serving transfers, and remove the spool folder if this engine made it."""
        if self.server is not None:
            self.server.close()
            self.server = None
        if self._own_spool:
            shutil.rmtree(self.folder, ignore_errors=True)

    def needs_fetch(self, params: Any) -> bool:
        """Whether a request's kv_transfer_params name a transfer still on its producer (TCP): `fetch`
        brings it here before the request is added."""
        return (self.config.over_tcp and self.config.consumes and isinstance(params, dict)
                and bool(params.get("do_remote_prefill")) and "remote_kv_path" not in params)

    def fetch(self, params: dict[str, Any], num_prompt_tokens: int) -> dict[str, Any]:
        """The kv_transfer_params of a request whose transfer (TCP) is now in this engine's spool folder,
        or params that prefill locally when it cannot be fetched (the log says why). Thread-safe: it reads
        only the configuration and writes only a fresh file."""
        self._remove_stale()
        max_blocks = (num_prompt_tokens - 1) // self.kv_cache.block_size
        host, port, transfer_id = (params.get(k) for k in ("remote_host", "remote_port", "remote_transfer_id"))
        local = os.path.join(self.folder, f"{uuid.uuid4().hex}.kv")
        try:
            if not (isinstance(host, str) and isinstance(port, int) and isinstance(transfer_id, str)):
                raise TransferRefused("kv_transfer_params need remote_host, remote_port and remote_transfer_id")
            if max_blocks == 0:
                raise TransferRefused("the prompt has no full block to take")
            fetch_transfer(host, port, transfer_id, local, max_blocks, self.fingerprint["block_bytes"],
                           self.config.fetch_timeout_s)
        except TransferRefused as exc:
            with self._count_lock:
                self.num_refused += 1
            logger.warning("a request prefills locally: its KV transfer cannot be fetched (%s)", exc)
            return {"do_remote_prefill": False, "do_remote_decode": False}
        return {**params, "remote_kv_path": local}

    def check_params(self, params: Any) -> None:
        """ValueError naming what is wrong with a request's `kv_transfer_params` (before it is queued)."""
        if not isinstance(params, dict):
            raise ValueError("kv_transfer_params must be an object")
        if params.get("do_remote_decode") and not self.config.produces:
            raise ValueError(f"kv_transfer_params.do_remote_decode: this server's kv_role is "
                             f"{self.config.kv_role!r}, it does not produce transfers")
        if params.get("do_remote_prefill") and not self.config.consumes:
            raise ValueError(f"kv_transfer_params.do_remote_prefill: this server's kv_role is "
                             f"{self.config.kv_role!r}, it does not consume transfers")

    def remove_imported(self, paths: list[str]) -> None:
        """The runner has read these files: they are no one's any more."""
        for path in paths:
            for name in (path, path + ".json"):
                try:
                    os.remove(name)
                except OSError:
                    pass

    def _remove_stale(self) -> None:
        now = time.time()
        try:
            entries = list(os.scandir(self.folder))
        except OSError:
            return
        for entry in entries:
            if entry.name.endswith((".kv", ".kv.json")):
                try:
                    if now - entry.stat().st_mtime > _STALE_S:
                        os.remove(entry.path)
                except OSError:
                    pass

    def plan_export(self, request: Request) -> None:
        """Have `request`'s prompt blocks written to a fresh file once computed."""
        request.kv_export_path = os.path.join(self.folder, f"{uuid.uuid4().hex}.kv")

    def describe(self, request: Request) -> dict[str, Any]:
        """The finished producer request's kv_transfer_params (and its description file, written now)."""
        self._remove_stale()
        blocks = request.kv_exported_blocks or 0
        path = request.kv_export_path
        if blocks == 0:
            return {"do_remote_prefill": False, "do_remote_decode": False}
        keys = self.kv_cache.prompt_keys(request, blocks)
        with open(path, "rb") as handle:
            data = handle.read()
        description = {"version": _VERSION, "fingerprint": self.fingerprint, "block_size": self.kv_cache.block_size,
                       "num_blocks": blocks, "block_hashes": [digest.hex() for digest, _ in keys],
                       "bytes": len(data), "crc32": zlib.crc32(data)}
        with open(path + ".json.partial", "w") as handle:
            json.dump(description, handle)
        os.replace(path + ".json.partial", path + ".json")
        where: dict[str, Any] = {"remote_kv_path": path}
        if self.server is not None:
            where = {**self._served_at, "remote_transfer_id": os.path.basename(path)[:-len(".kv")]}
        return {"do_remote_prefill": True, "do_remote_decode": False, **where,
                "remote_num_blocks": blocks, "remote_block_size": self.kv_cache.block_size}

    def adopt(self, request: Request, params: dict[str, Any]) -> int:
        """Take a consumer request's transferred blocks into the prefix cache; how many prompt tokens they
        cover (0 when the transfer was refused: the request prefills locally)."""
        try:
            path, keys = self._checked(request, params)
        except TransferRefused as exc:
            with self._count_lock:
                self.num_refused += 1
            logger.warning("request %s prefills locally: its KV transfer is unusable (%s)", request.request_id, exc)
            path = params.get("remote_kv_path")
            if self.config.over_tcp and self._in_folder(path):
                self.remove_imported([path])  # fetched into this engine's spool: no one else's
            return 0
        adopted = self.kv_cache.transfer.adopt(request.request_id, keys, path, request.sampling_params.key_salt)
        self.num_imported += 1
        return adopted * self.kv_cache.block_size

    def _in_folder(self, path: Any) -> bool:
        """Whether `path` names a file directly in this engine's transfer folder."""
        return isinstance(path, str) and os.path.dirname(os.path.abspath(path)) == os.path.abspath(self.folder)

    def _checked(self, request: Request, params: dict[str, Any]) -> tuple[str, list]:
        """The transfer file and the keys of the prompt blocks it holds, or TransferRefused saying why."""
        path = params.get("remote_kv_path")
        if not self._in_folder(path):
            raise TransferRefused(f"remote_kv_path must be a file of {self.folder}")
        try:
            with open(path + ".json") as handle:
                description = json.load(handle)
            with open(path, "rb") as handle:
                data = handle.read()
        except (OSError, ValueError) as exc:
            raise TransferRefused(f"cannot read {path}: {exc}") from None
        if description.get("version") != _VERSION or description.get("fingerprint") != self.fingerprint:
            raise TransferRefused("it was written by another model, dtype or layout")
        if description.get("block_size") != self.kv_cache.block_size:
            raise TransferRefused(f"its block size is {description.get('block_size')}, this engine's "
                                  f"{self.kv_cache.block_size}")
        blocks = description.get("num_blocks")
        if not isinstance(blocks, int) or not 0 < blocks <= (request.num_prompt_tokens - 1) // self.kv_cache.block_size:
            raise TransferRefused(f"it holds {blocks} blocks, more than this prompt's full blocks")
        if len(data) != blocks * self.fingerprint["block_bytes"]:
            raise TransferRefused(f"it has {len(data)} bytes, not {blocks} blocks of this engine's layout")
        if len(data) != description.get("bytes") or zlib.crc32(data) != description.get("crc32"):
            raise TransferRefused("its data is incomplete or damaged (length or CRC-32)")
        keys = self.kv_cache.prompt_keys(request, blocks)
        if [digest.hex() for digest, _ in keys] != description.get("block_hashes"):
            raise TransferRefused("its blocks hold another prompt")
        return path, keys
