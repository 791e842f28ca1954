"""How a server meets its clients beneath the API: HTTPS (uvicorn's TLS settings from --ssl-*) and CORS (which
browser origins' pages may call it, from --allowed-origins; none by default). vLLM's flag names."""

from __future__ import annotations

from typing import Any

from tokenmill.config import ServerConfig


def tls_settings(config: ServerConfig) -> dict[str, Any]:
    """uvicorn.Config's keyword arguments for HTTPS ({} for plain HTTP). ServerConfig.validate has checked them."""
    if config.ssl_certfile is None:
        return {}
    return {"ssl_keyfile": config.ssl_keyfile, "ssl_certfile": config.ssl_certfile,
            "ssl_ca_certs": config.ssl_ca_certs, "ssl_cert_reqs": config.ssl_cert_reqs}


def add_cors(app: Any, config: ServerConfig) -> None:
    """Starlette's CORS middleware on `app` for the origins --allowed-origins names (nothing without them)."""
    if not config.allowed_origins:
        return
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins,
                       allow_methods=config.allowed_methods or ["*"], allow_headers=config.allowed_headers or ["*"],
                       allow_credentials=config.allow_credentials)

