"""Prefill/decode transfer across hosts: one framed TCP stream per transfer (TCPConnector).

The producer's `TransferServer` serves the transfer files its runner wrote to its spool folder (the
shared-storage connector's layout: `<id>.kv` and the description `<id>.kv.json`, engine/kv_transfer.py)
and removes them as a consumer claims one. The consumer's `fetch_transfer` copies it into its own spool folder, where
the same checks as for a shared file decide whether it is adopted.

Frames (integers big-endian):
- request:  b"TMKV", version (u8), id length (u8), id (ASCII hex);
- answer:   b"TMKV", status (u8: 0 found, 1 unknown), then when found: header length (u32), the header
            (the description's JSON), CRC-32 of the header (u32), data length (u64), the data. The
            description carries the data's CRC-32, checked as the data arrives.

Invariant: neither side waits without a bound or takes more than it expects. The consumer's fetch ends
by its deadline whatever the peer does (connect, each read, the whole transfer), and refuses a header
or data longer than the blocks its own prompt can use; the producer's handlers time out on a silent
consumer, and past `MAX_CONNECTIONS` at once a connection is closed unanswered.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import struct
import threading
import time
import zlib
from typing import Optional

logger = logging.getLogger(__name__)

MAGIC = b"TMKV"
VERSION = 1
FOUND, UNKNOWN = 0, 1
MAX_CONNECTIONS = 16
SEND_TIMEOUT_S = 30.0
_ID = re.compile(r"[0-9a-f]{1,64}\Z")
_CHUNK = 1 << 20


class TransferRefused(Exception):
    """A transfer that cannot be used; the request prefills locally."""


def header_limit(max_blocks: int) -> int:
    """The longest description a transfer of at most `max_blocks` blocks can have (its fixed fields, the
    model's fingerprint, and one 64-digit hash per block)."""
    return 8192 + 80 * max_blocks


class TransferServer:
    """The producer's listener: answers each request for a transfer id with its spool files."""

    def __init__(self, spool: str, host: str, port: int) -> None:
        self.spool = spool
        try:
            self._socket = socket.create_server((host, port), reuse_port=False)
        except OSError as exc:
            raise ValueError(f"kv_transfer_config: cannot listen on {host}:{port} for KV transfers ({exc})") from None
        self.port = self._socket.getsockname()[1]
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="kv-transfer-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop listening (transfers being sent finish on their own threads)."""
        self._closed = True
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._socket.close()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._socket.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kv-transfer-send", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(SEND_TIMEOUT_S)
                magic, version, length = struct.unpack(">4sBB", _recv_exact(conn, 6, None))
                transfer_id = _recv_exact(conn, length, None).decode("ascii", "replace")
                if magic != MAGIC or version != VERSION or not _ID.match(transfer_id):
                    return
                self._send(conn, os.path.join(self.spool, f"{transfer_id}.kv"))
        except (OSError, TransferRefused, struct.error) as exc:
            logger.info("a KV transfer connection ended early: %s", exc)
        finally:
            self._slots.release()

    @staticmethod
    def _send(conn: socket.socket, path: str) -> None:
        try:
            with open(path + ".json", "rb") as handle:
                header = handle.read()
            data = open(path, "rb")
        except OSError:
            conn.sendall(MAGIC + bytes([UNKNOWN]))
            return
        # one decode server takes a transfer: its files leave the spool as it is claimed (the open handle
        # still reads them), so they are gone before the consumer has its last byte; a send that fails
        # midway leaves the consumer to prefill locally
        for name in (path, path + ".json"):
            try:
                os.remove(name)
            except OSError:
                pass
        with data:
            size = os.fstat(data.fileno()).st_size
            conn.sendall(MAGIC + bytes([FOUND]) + struct.pack(">I", len(header)) + header
                         + struct.pack(">IQ", zlib.crc32(header), size))
            conn.sendfile(data)


def fetch_transfer(host: str, port: int, transfer_id: str, into: str, max_blocks: int, block_bytes: int,
                   timeout_s: float) -> None:
    """Copy transfer `transfer_id` from the producer at host:port to `into` (data) and `into`.json (its
    description), or raise TransferRefused saying why. At most `max_blocks` blocks are taken, and the
    whole fetch ends within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    if not _ID.match(transfer_id):
        raise TransferRefused(f"remote_transfer_id {transfer_id!r} is not a transfer id")
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise TransferRefused(f"cannot reach the prefill server's KV port {host}:{port} ({exc})") from None
    with sock:
        try:
            sock.sendall(struct.pack(">4sBB", MAGIC, VERSION, len(transfer_id)) + transfer_id.encode("ascii"))
            magic, status = struct.unpack(">4sB", _recv_exact(sock, 5, deadline))
            if magic != MAGIC:
                raise TransferRefused(f"{host}:{port} does not speak the KV transfer protocol")
            if status != FOUND:
                raise TransferRefused(f"{host}:{port} has no transfer {transfer_id} (already taken, or expired)")
            (header_len,) = struct.unpack(">I", _recv_exact(sock, 4, deadline))
            if header_len > header_limit(max_blocks):
                raise TransferRefused(f"its description has {header_len} bytes, more than {max_blocks} blocks need")
            header = _recv_exact(sock, header_len, deadline)
            crc, size = struct.unpack(">IQ", _recv_exact(sock, 12, deadline))
            if zlib.crc32(header) != crc:
                raise TransferRefused("its description is damaged (CRC-32)")
            try:
                description = json.loads(header)
            except ValueError:
                raise TransferRefused("its description is not JSON") from None
            if not isinstance(description, dict) or description.get("bytes") != size:
                raise TransferRefused("its description does not match its data's length")
            if size > max_blocks * block_bytes:
                raise TransferRefused(f"it has {size} bytes, more than the {max_blocks} blocks this prompt can use")
            _receive_file(sock, size, description.get("crc32"), into, deadline)
        except OSError as exc:
            raise TransferRefused(f"the transfer from {host}:{port} broke off ({exc})") from None
    with open(into + ".json.partial", "wb") as handle:
        handle.write(header)
    os.replace(into + ".json.partial", into + ".json")


def _receive_file(sock: socket.socket, size: int, crc: object, into: str, deadline: float) -> None:
    partial = into + ".partial"
    running = 0
    try:
        with open(partial, "wb") as handle:
            left = size
            while left:
                piece = _recv_some(sock, min(left, _CHUNK), deadline)
                running = zlib.crc32(piece, running)
                handle.write(piece)
                left -= len(piece)
        if running != crc:
            raise TransferRefused("its data is damaged (CRC-32)")
        os.replace(partial, into)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def _recv_some(sock: socket.socket, limit: int, deadline: Optional[float]) -> bytes:
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferRefused("it did not arrive in time")
        sock.settimeout(left)
    try:
        piece = sock.recv(limit)
    except socket.timeout:
        raise TransferRefused("it did not arrive in time") from None
    if not piece:
        raise TransferRefused("the stream ended early (truncated)")
    return piece


def _recv_exact(sock: socket.socket, size: int, deadline: Optional[float]) -> bytes:
    parts, left = [], size
    while left:
        piece = _recv_some(sock, left, deadline)
        parts.append(piece)
        left -= len(piece)
    return b"".join(parts)
