"""The TCP transfer's wire (engine/kv_transfer_tcp.py): a transfer arrives whole or is refused, and no peer
(silent, slow, lying, damaged, truncated, talking garbage) holds the consumer past its deadline."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import zlib

import pytest

from tokenmill.engine.kv_transfer_tcp import (
    FOUND, MAGIC, MAX_CONNECTIONS, TransferRefused, TransferServer, fetch_transfer, header_limit)
from tokenmill.kv_transfer_config import KVTransferConfig

BLOCK_BYTES = 1000
TRANSFER_ID = "ab12"


def write_transfer(spool, data: bytes, **overrides) -> bytes:
    description = {"version": 1, "num_blocks": len(data) // BLOCK_BYTES, "bytes": len(data),
                   "crc32": zlib.crc32(data), **overrides}
    header = json.dumps(description).encode()
    (spool / f"{TRANSFER_ID}.kv").write_bytes(data)
    (spool / f"{TRANSFER_ID}.kv.json").write_bytes(header)
    return header


@pytest.fixture
def server(tmp_path):
    spool = tmp_path / "producer"
    spool.mkdir()
    server = TransferServer(str(spool), "127.0.0.1", 0)
    yield server, spool
    server.close()


def fetch(port, into, max_blocks=4, timeout=5.0, transfer_id=TRANSFER_ID):
    fetch_transfer("127.0.0.1", port, transfer_id, str(into), max_blocks, BLOCK_BYTES, timeout)


def test_a_transfer_arrives_whole_and_leaves_the_producer(server, tmp_path):
    server, spool = server
    data = os.urandom(3 * BLOCK_BYTES)
    header = write_transfer(spool, data)
    fetch(server.port, tmp_path / "got.kv")
    assert (tmp_path / "got.kv").read_bytes() == data
    assert (tmp_path / "got.kv.json").read_bytes() == header
    assert not list(spool.iterdir())  # one decode server takes a transfer
    with pytest.raises(TransferRefused, match="has no transfer"):
        fetch(server.port, tmp_path / "again.kv")
    assert not (tmp_path / "again.kv").exists()


def test_damaged_data_is_refused_and_leaves_no_file(server, tmp_path):
    server, spool = server
    data = bytearray(os.urandom(2 * BLOCK_BYTES))
    write_transfer(spool, bytes(data))
    data[5] ^= 1
    (spool / f"{TRANSFER_ID}.kv").write_bytes(bytes(data))
    with pytest.raises(TransferRefused, match="damaged"):
        fetch(server.port, tmp_path / "got.kv")
    assert list(tmp_path.glob("got*")) == []


def test_more_blocks_than_the_prompt_can_use_are_refused_before_they_are_read(server, tmp_path):
    server, spool = server
    write_transfer(spool, os.urandom(5 * BLOCK_BYTES))
    with pytest.raises(TransferRefused, match="more than the 4 blocks"):
        fetch(server.port, tmp_path / "got.kv", max_blocks=4)


def test_a_bad_transfer_id_never_reaches_the_peer(tmp_path):
    with pytest.raises(TransferRefused, match="not a transfer id"):
        fetch(1, tmp_path / "got.kv", transfer_id="../../etc/passwd")


def test_an_unreachable_producer_is_refused(tmp_path):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(TransferRefused, match="cannot reach"):
        fetch(port, tmp_path / "got.kv")


class FakePeer:
    """A producer that answers every connection with `behave(conn)`, then holds it until released."""

    def __init__(self, behave):
        self.behave = behave
        self.release = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    self.behave(conn)
                except OSError:
                    pass
                self.release.wait(30)

    def close(self):
        self.release.set()
        self.sock.close()


def found_frame(header: bytes, size: int) -> bytes:
    return MAGIC + bytes([FOUND]) + struct.pack(">I", len(header)) + header + struct.pack(">IQ", zlib.crc32(header), size)


def silent(conn):
    conn.recv(100)


def garbage(conn):
    conn.recv(100)
    conn.sendall(b"HTTP/1.1 200 OK\r\n\r\nhello")


def truncated(conn):
    conn.recv(100)
    data = os.urandom(2 * BLOCK_BYTES)
    header = json.dumps({"bytes": len(data), "crc32": zlib.crc32(data)}).encode()
    conn.sendall(found_frame(header, len(data)) + data[:BLOCK_BYTES])
    conn.close()


def trickling(conn):
    conn.recv(100)
    data = os.urandom(2 * BLOCK_BYTES)
    header = json.dumps({"bytes": len(data), "crc32": zlib.crc32(data)}).encode()
    conn.sendall(found_frame(header, len(data)))
    for byte in data:  # slower than any deadline: a byte now and then, each read answered
        conn.sendall(bytes([byte]))
        if threading.Event().wait(0.05):
            return


def huge_header(conn):
    conn.recv(100)
    conn.sendall(MAGIC + bytes([FOUND]) + struct.pack(">I", 1 << 31))


def lying_length(conn):
    conn.recv(100)
    header = json.dumps({"bytes": 10, "crc32": 0}).encode()
    conn.sendall(found_frame(header, 1 << 40))


def damaged_header(conn):
    conn.recv(100)
    header = json.dumps({"bytes": 10, "crc32": 0}).encode()
    frame = bytearray(found_frame(header, 10))
    frame[12] ^= 0x20
    conn.sendall(bytes(frame))


@pytest.mark.parametrize("behave, reason", [
    (silent, "did not arrive in time"),
    (garbage, "does not speak"),
    (truncated, "ended early"),
    (trickling, "did not arrive in time"),
    (huge_header, "more than 4 blocks need"),
    (lying_length, "does not match"),
    (damaged_header, "description is damaged"),
])
def test_no_peer_holds_the_consumer_past_its_deadline_or_fills_it(tmp_path, behave, reason):
    peer = FakePeer(behave)
    try:
        with pytest.raises(TransferRefused, match=reason):
            fetch(peer.port, tmp_path / "got.kv", timeout=1.0)
    finally:
        peer.close()
    assert list(tmp_path.glob("got*")) == []


def test_silent_consumers_do_not_keep_the_producer_from_others(server, tmp_path):
    server, spool = server
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(MAX_CONNECTIONS - 1)]
    try:
        data = os.urandom(BLOCK_BYTES)
        write_transfer(spool, data)
        fetch(server.port, tmp_path / "got.kv")
        assert (tmp_path / "got.kv").read_bytes() == data
    finally:
        for sock in idle:
            sock.close()


def test_past_the_connection_limit_a_connection_is_closed_unanswered(server):
    server, _ = server
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(MAX_CONNECTIONS)]
    try:
        extra = socket.create_connection(("127.0.0.1", server.port), timeout=20)
        idle.append(extra)
        assert extra.recv(1) == b""
    finally:
        for sock in idle:
            sock.close()


def test_header_limit_grows_with_the_blocks():
    assert header_limit(512) > len(json.dumps({"block_hashes": ["f" * 64] * 512}))


def test_tcp_config_keys_and_their_errors():
    config = KVTransferConfig.parse({"kv_connector": "TCPConnector", "kv_role": "kv_producer", "kv_ip": "0.0.0.0",
                                     "kv_port": 15000, "kv_connector_extra_config": {"advertise_host": "p1.local"}})
    assert (config.over_tcp, config.produces, config.kv_port, config.public_host) == (True, True, 15000, "p1.local")
    assert config.shared_storage_path is None and config.fetch_timeout_s == 10.0
    for bad, message in [({"kv_port": 70000}, "kv_port"), ({"kv_ip": ""}, "kv_ip"),
                         ({"kv_connector_extra_config": {"fetch_timeout_s": 0}}, "fetch_timeout_s"),
                         ({"kv_connector_extra_config": {"bogus": 1}}, "does not take")]:
        with pytest.raises(ValueError, match=message):
            KVTransferConfig.parse({"kv_connector": "TCPConnector", **bad})
    with pytest.raises(ValueError, match="TCPConnector's"):
        KVTransferConfig.parse({"kv_connector": "SharedStorageConnector", "kv_port": 1,
                                "kv_connector_extra_config": {"shared_storage_path": "/tmp/x"}})


def test_a_port_in_use_is_a_clear_error(server):
    server, _ = server
    with pytest.raises(ValueError, match="cannot listen"):
        TransferServer("/tmp", "127.0.0.1", server.port)
