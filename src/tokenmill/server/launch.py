"""`tokenmill serve`: load the model, start the engine thread, run uvicorn, shut down gracefully."""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, Callable, Optional

from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.server.transport import tls_settings

if TYPE_CHECKING:
    from tokenmill.server.tenants import Tenants

logger = logging.getLogger(__name__)

# The engine thread takes the GIL back after every PyTorch op and kernel call; while the event loop
# holds it, the engine waits up to the switch interval (5 ms by default). 1 ms measured 6% more
# throughput under 16 streams (docs/benchmarks.md).
_GIL_SWITCH_INTERVAL_S = 0.001
_ENGINE_DEAD_EXIT = 3  # the engine died while serving (`tokenmill serve` exits 2 on a bad flag)


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Serve until SIGINT/SIGTERM. On SIGTERM: stop admitting, let running requests finish for up to
    `shutdown_timeout` seconds, abort the rest, exit 0. If the engine dies, exit 3. On SIGHUP, read the tenants
    file again."""
    import uvicorn

    from tokenmill.server.tenant_gate import server_tenants

    server_config.validate()
    tenants = server_tenants(server_config)
    engine_config = tenant_step_budget(engine_config, server_config, tenants)
    sys.setswitchinterval(_GIL_SWITCH_INTERVAL_S)
    name = server_config.served_model_name or default_name(engine_config.model.model)
    died: list[str] = []
    servers: list[uvicorn.Server] = []

    def on_dead(reason: str) -> None:
        """The engine cannot run any more: stop serving and exit non-zero, so a supervisor restarts us."""
        logger.error("the engine is dead (%s); shutting the server down", reason)
        died.append(reason)
        for running in servers:
            running.should_exit = True

    app, stop_accepting, shutdown = make_app(engine_config, server_config, name, tenants, on_dead)
    if server_config.tenants_file is not None:
        tenants_file = server_config.tenants_file
        signal.signal(signal.SIGHUP, lambda sig, frame: reload_tenants(app.state.tenant_gate, tenants_file))

    class _GracefulServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            stop_accepting()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=server_config.host, port=server_config.port, log_level="info",
                            timeout_graceful_shutdown=server_config.shutdown_timeout, access_log=False,
                            **tls_settings(server_config))
    server = _GracefulServer(config)
    servers.append(server)
    server.should_exit = bool(died)
    # uvicorn re-raises the signal it stopped on once it has shut down gracefully; with the default
    # SIGTERM action that kills the process (exit -15) before the engine shuts down. Exit 0 instead.
    previous = signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl-C: the same graceful path, re-raised by uvicorn at its end
        pass
    finally:
        shutdown()
        signal.signal(signal.SIGTERM, previous)
    return _ENGINE_DEAD_EXIT if died else 0


def tenant_step_budget(engine_config: EngineConfig, server_config: ServerConfig,
                       tenants: Optional["Tenants"]) -> EngineConfig:
    """The engine's configuration with the prompt tokens of a step capped at `--tenant-step-tokens` when two or more
    tenants share the server: a step on a CPU takes as long as its tokens, and a request that arrives waits for the
    step in flight before the fair share can start it."""
    import dataclasses

    cap, scheduler = server_config.tenant_step_tokens, engine_config.scheduler
    already = scheduler.max_num_prompt_tokens or scheduler.max_num_batched_tokens
    if tenants is None or len(tenants.tenants) < 2 or not 0 < cap < already:
        return engine_config
    logger.info("%d tenants share the server: steps of at most %d prompt tokens, decodes on top "
                "(--tenant-step-tokens)", len(tenants.tenants), cap)
    return dataclasses.replace(engine_config, scheduler=dataclasses.replace(scheduler, max_num_prompt_tokens=cap))


def make_app(engine_config: EngineConfig, server_config: ServerConfig, name: str, tenants: Optional["Tenants"],
             on_dead: Optional[Callable[[str], None]] = None) -> tuple[Any, Callable[[], None], Callable[[], None]]:
    """The server's app over a new engine (a generating model's, or an embedding model's), and the engine's
    stop-admitting and shutdown calls: what `tokenmill serve` listens with and `tokenmill run-batch` posts to."""
    from tokenmill.engine.admission import AdmissionLimits
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.pooling.pooler_config import runs_pooling
    from tokenmill.server.api_server import build_app

    if runs_pooling(engine_config.model):
        return _pooling_app(engine_config, server_config, name, tenants)
    limits = AdmissionLimits(server_config.max_waiting_requests, server_config.max_waiting_tokens,
                             server_config.grammar_compile_timeout)
    tracer = None
    if server_config.otlp_traces_endpoint:
        from tokenmill.engine.tracing import RequestTracer
        tracer = RequestTracer(server_config.otlp_traces_endpoint, name)
    async_engine = AsyncEngine(lambda: _with_adapters(LLMEngine(engine_config), server_config.lora_modules),
                               name, limits, on_dead, tracer)
    app = build_app(async_engine, server_config, async_engine.info.chat_template, tenants)
    return app, async_engine.stop_accepting, async_engine.shutdown


def _with_adapters(engine: Any, modules: Optional[list[str]]) -> Any:
    """The engine with the `--lora-modules` adapters registered (ValueError naming a bad one)."""
    from tokenmill.server.lora_routes import parse_lora_modules

    adapters = parse_lora_modules(modules)
    if adapters and engine.loras is None:
        engine.shutdown()
        raise ValueError("lora_modules: serving LoRA adapters needs --enable-lora")
    try:
        for adapter_name, path in adapters:
            engine.loras.add(adapter_name, path)
    except ValueError as exc:
        engine.shutdown()
        raise ValueError(f"lora_modules: {exc}") from None
    return engine


def _pooling_app(engine_config: EngineConfig, server_config: ServerConfig, name: str, tenants: Optional["Tenants"]):
    """An embedding model's app, and its engine's stop-admitting and shutdown calls."""
    from tokenmill.pooling.engine import PoolingEngine
    from tokenmill.models.loader import model_location
    from tokenmill.pooling.model import load_embedding_model
    from tokenmill.server.pooling_app import build_pooling_app

    model = engine_config.model
    if server_config.otlp_traces_endpoint:
        raise ValueError("--otlp-traces-endpoint traces generation requests; an embedding model's server has none")
    embedder = load_embedding_model(model.model, model.dtype, model.device, model.max_model_len,
                                    model.attention_backend, name, any_decoder=model.runner == "pooling",
                                    location=model_location(model))
    logger.info("embedding model: %s", embedder.description)
    sched = engine_config.scheduler
    engine = PoolingEngine(embedder, sched.max_num_batched_tokens, sched.max_num_seqs,
                           server_config.max_waiting_requests)
    return build_pooling_app(engine, server_config, name, tenants), engine.stop_accepting, engine.shutdown


def reload_tenants(gate: Any, path: str) -> None:
    """Serve the tenants file's tenants from now on; a file that cannot be read or is wrong changes nothing and
    says why in the log."""
    from tokenmill.server.tenants import Tenants

    try:
        gate.reload(Tenants.from_file(path))
    except ValueError as exc:
        logger.error("the tenants file was not reloaded; the tenants stay as they were: %s", exc)


def _exit_cleanly(sig: int, frame: Any) -> None:
    raise SystemExit(0)


def default_name(model: Optional[str]) -> str:
    """The name a server answers to when none is given: the model argument (a path without its trailing slash)."""
    from tokenmill.models.loader import DEFAULT_MODEL
    if model is None:
        return DEFAULT_MODEL
    return model if not os.path.exists(model) else model.rstrip("/")
