"""`tokenmill serve --data-parallel-size N`: start N replicas, the prefix index and the front, and stop them."""

from __future__ import annotations

import logging
import socket
from typing import Any

from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.server.transport import add_cors, tls_settings

logger = logging.getLogger(__name__)
_EXIT_REPLICAS_DIED = 3


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def run_data_parallel(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Serve on server_config's port until SIGINT/SIGTERM, each request on one of the replicas (a replica
    that dies is started again); exit 3 when every replica has failed to start."""
    import uvicorn

    from tokenmill.balancer.app import PromptReader, build_balancer_app
    from tokenmill.balancer.kv_index import PrefixIndex
    from tokenmill.balancer.policy import Balancer, Replica
    from tokenmill.balancer.replicas import plan_replicas
    from tokenmill.balancer.response_homes import ResponseHomes
    from tokenmill.models.loader import load_model_source, model_location

    server_config.validate()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health check
    if engine_config.parallel.nnodes > 1:
        raise ValueError("data_parallel_size runs every replica on this host: it cannot be combined with nnodes > 1")
    # the tokenizer and chat template, not the weights
    source = load_model_source(engine_config.model.model, **model_location(engine_config.model))
    api_key = server_config.resolved_api_key()
    processes = plan_replicas(engine_config, server_config, _free_ports(server_config.data_parallel_size), api_key)
    sources = [p.events for p in processes]
    index = PrefixIndex(sources) if all(s is not None for s in sources) else None
    balancer = Balancer([Replica(p.rank, p.url) for p in processes], index, engine_config.cache.block_size,
                        engine_config.cache.prefix_caching_hash_seed)
    died: list[bool] = []
    servers: list[Any] = []

    def on_all_exited() -> None:
        logger.error("no replica could start; shutting the front down")
        died.append(True)
        for running in servers:
            running.should_exit = True

    app = build_balancer_app(balancer, processes, PromptReader(source.tokenizer, source.chat_template),
                             int(server_config.max_request_body_mb * (1 << 20)), on_all_exited,
                             ResponseHomes(server_config.max_stored_responses * len(processes)))
    logger.info("starting %d replicas of %s (prefix affinity %s)", len(processes), source.path,
                "from their KV events" if index is not None else "off: prefix caching is off")
    for process in processes:
        process.start()
    add_cors(app, server_config)
    server = uvicorn.Server(uvicorn.Config(app, host=server_config.host, port=server_config.port,
                                           log_level="info", access_log=False,
                                           timeout_graceful_shutdown=server_config.shutdown_timeout,
                                           **tls_settings(server_config)))
    servers.append(server)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        for process in processes:
            process.stop(server_config.shutdown_timeout + 5)
        if index is not None:
            index.close()
    return _EXIT_REPLICAS_DIED if died else 0
