"""Ranks on other hosts: node 0's engine accepts their workers' connections; a node of rank > 0 runs only workers.

A multi-node run follows torchrun's conventions (`--nnodes`, `--node-rank`, `--master-addr`,
`--master-port`): node k runs ranks [k * R, (k + 1) * R) of the tensor x pipeline grid, R = world / nnodes.
The ranks meet for torch.distributed at master_addr:master_port (hosted by rank 0, on node 0). Each worker
of another node connects to the engine at master_addr:master_port + 1, where it receives its WorkerSpec
and then every step, framed as on a local worker's pipe. Both ends authenticate with TOKENMILL_DIST_KEY
(multiprocessing's HMAC challenge) before anything is unpickled.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import socket
import struct
import time
from multiprocessing import AuthenticationError, connection
from typing import TYPE_CHECKING, Optional

from tokenmill.executor.rank_start import Surroundings, rank_context

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig, ParallelConfig
    from tokenmill.worker.worker import WorkerSpec

logger = logging.getLogger(__name__)

# A peer that connected gets this long to authenticate and say its rank.
_HANDSHAKE_SECONDS = 10.0
_HANDSHAKE_ERRORS = (AuthenticationError, OSError, EOFError, ValueError)


def step_address(parallel: "ParallelConfig") -> tuple[str, int]:
    """Where node 0's engine listens for the other nodes' workers."""
    return parallel.master_addr, parallel.master_port + 1


def accept_remote_ranks(spec: "WorkerSpec", parallel: "ParallelConfig", key: bytes,
                        pipes: list[Optional[connection.Connection]]) -> None:
    """Fill `pipes[rank]` for every rank of the other nodes as its worker connects, sending it its spec.

    Raises RuntimeError naming the ranks that did not connect within `parallel.distributed_timeout`.
    A connection that fails to authenticate or names a rank not awaited is refused and logged.
    """
    address = step_address(parallel)
    pending = set(range(parallel.ranks_per_node, spec.world_size))
    try:
        server = socket.create_server(address)
    except OSError as exc:
        raise RuntimeError(f"cannot listen for the other nodes' workers at {address[0]}:{address[1]} "
                           f"(master_port + 1): {exc}") from exc
    deadline = time.monotonic() + parallel.distributed_timeout
    try:
        server.settimeout(0.5)
        while pending and time.monotonic() < deadline:
            try:
                sock, peer = server.accept()
            except socket.timeout:
                continue
            admitted = _admit(sock, key, pending)
            if admitted is None:
                continue
            rank, pipe = admitted
            pipe.send_bytes(pickle.dumps(dataclasses.replace(spec, rank=rank), protocol=pickle.HIGHEST_PROTOCOL))
            pipes[rank] = pipe
            pending.discard(rank)
            logger.info("worker rank %d connected from %s", rank, peer[0])
    finally:
        server.close()
    if pending:
        nodes = sorted({rank // parallel.ranks_per_node for rank in pending})
        raise RuntimeError(
            f"worker ranks {sorted(pending)} (node_rank {', '.join(map(str, nodes))}) did not connect to "
            f"{address[0]}:{address[1]} within {parallel.distributed_timeout:g} s: on each other node run "
            f"`tokenmill serve MODEL --nnodes {parallel.nnodes} --node-rank K --master-addr "
            f"{parallel.master_addr} --master-port {parallel.master_port}` with the same parallel sizes and "
            f"TOKENMILL_DIST_KEY")


def _admit(sock: socket.socket, key: bytes, pending: set[int]) -> Optional[tuple[int, connection.Connection]]:
    """Authenticate a connected peer and read the rank it runs; None (and the socket closed) if refused."""
    conn = _handshake_connection(sock)
    try:
        connection.deliver_challenge(conn, key)
        connection.answer_challenge(conn, key)
        rank = int(conn.recv_bytes(16))
    except _HANDSHAKE_ERRORS as exc:
        logger.warning("refused a worker connection: %s: %s", type(exc).__name__, exc)
        conn.close()
        return None
    if rank not in pending:
        logger.warning("refused a worker connection for rank %d: not a rank awaited (%s)", rank, sorted(pending))
        conn.close()
        return None
    _set_receive_timeout(conn, 0.0)  # steps may be long apart
    return rank, conn


def connect_to_engine(address: tuple[str, int], key: bytes, rank: int, timeout: float) -> connection.Connection:
    """Connect worker `rank` to node 0's engine, retrying until `timeout`; RuntimeError saying why not."""
    deadline = time.monotonic() + timeout
    last: Optional[BaseException] = None
    while time.monotonic() < deadline:
        try:
            sock = socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()))
        except OSError as exc:  # not listening yet, or not reachable yet
            last = exc
            time.sleep(0.5)
            continue
        conn = _handshake_connection(sock)
        try:
            connection.answer_challenge(conn, key)
            connection.deliver_challenge(conn, key)
            conn.send_bytes(str(rank).encode())
        except AuthenticationError as exc:
            conn.close()
            raise RuntimeError(f"node 0 at {address[0]}:{address[1]} refused worker rank {rank}: "
                               f"TOKENMILL_DIST_KEY differs from node 0's ({exc})") from exc
        except (OSError, EOFError) as exc:
            conn.close()
            last = exc
            time.sleep(0.5)
            continue
        _set_receive_timeout(conn, 0.0)
        return conn
    raise RuntimeError(f"worker rank {rank} could not reach node 0's engine at {address[0]}:{address[1]} "
                       f"within {timeout:g} s (is `tokenmill serve --node-rank 0` running there?): {last}")


def run_worker_node(config: "EngineConfig") -> int:
    """Run this node's workers (node_rank > 0) until node 0's engine stops them; 0 when every worker
    ended cleanly, 1 otherwise. SIGTERM or Ctrl-C stops them."""
    from tokenmill.envs import distributed_key
    from tokenmill.models.loader import model_location, resolve_model_path

    parallel = config.parallel
    key = distributed_key()
    model_path = resolve_model_path(config.model.model, **model_location(config.model))  # this host's copy
    first = parallel.node_rank * parallel.ranks_per_node
    ranks = range(first, first + parallel.ranks_per_node)
    context = rank_context()
    level = logging.getLogger().getEffectiveLevel()
    processes = [context.Process(target=remote_worker_main, name=f"tokenmill-worker-{rank}",
                                 args=(step_address(parallel), key, rank, model_path, parallel.distributed_timeout,
                                       level, Surroundings.now()))
                 for rank in ranks]
    logger.info("node %d of %d: worker ranks %d-%d of %d, engine at %s:%d", parallel.node_rank, parallel.nnodes,
                ranks[0], ranks[-1], parallel.world_size, *step_address(parallel))

    def stop(sig: int, frame: object) -> None:
        for process in processes:
            if process.is_alive():
                process.terminate()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        for process in processes:
            process.start()
        for process in processes:
            process.join()
    except KeyboardInterrupt:
        stop(signal.SIGINT, None)
        for process in processes:
            process.join()
    finally:
        signal.signal(signal.SIGTERM, previous)
    codes = [process.exitcode for process in processes]
    if any(codes):
        logger.error("worker exit codes: %s", dict(zip(ranks, codes)))
        return 1
    return 0


def remote_worker_main(address: tuple[str, int], key: bytes, rank: int, model_path: str, timeout: float,
                       log_level: int, surroundings: Surroundings) -> None:
    """A worker process of another node: take on the node process's `surroundings`, connect to the engine,
    take the spec it sends, then serve steps exactly as a local worker does (worker_process.worker_main)."""
    from tokenmill.executor.worker_process import worker_main

    surroundings.enter()
    logging.basicConfig(level=log_level, format=f"%(asctime)s [worker {rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger(__name__).info("connecting to node 0's engine at %s:%d (for up to %g s)", *address, timeout)
    try:
        conn = connect_to_engine(address, key, rank, timeout)
        spec = pickle.loads(conn.recv_bytes())
    except (RuntimeError, OSError, EOFError) as exc:
        logging.getLogger(__name__).error("%s", exc)
        raise SystemExit(1)
    worker_main(dataclasses.replace(spec, model_path=model_path), conn, log_level)


def _handshake_connection(sock: socket.socket) -> connection.Connection:
    """A blocking Connection over `sock` whose reads give up after the handshake's time (a silent peer
    cannot stall the accepting loop); cleared with _set_receive_timeout once the peer is known."""
    sock.settimeout(None)
    conn = connection.Connection(sock.detach())
    _set_receive_timeout(conn, _HANDSHAKE_SECONDS)
    return conn


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


def _set_receive_timeout(conn: connection.Connection, seconds: float) -> None:
    """SO_RCVTIMEO on the connection's socket (0 = none)."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))
    finally:
        sock.close()
