"""HTTPS and CORS (server/transport.py, vLLM's flag names): the server's own app under uvicorn in a thread, with a
certificate a test CA issued (trustme): the official openai SDK completes over HTTPS when it trusts the CA file and
refuses the connection when it does not; a browser's preflight from an allowed origin gets CORS headers without
the API key, another origin gets none; bad TLS settings are refused naming the flag. Cost: one tiny engine (~1 s)."""

from __future__ import annotations

import ssl
import threading
import time

import httpx
import openai
import pytest
import trustme
import uvicorn

from helpers.agreeing_drafts import write_bigram_llama
from helpers.weight_trainer import free_port
from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.api_server import build_app
from tokenmill.server.tenants import Tenants
from tokenmill.server.transport import tls_settings

ALLOWED = "https://app.example"


@pytest.fixture(scope="module")
def https_server(tmp_path_factory):
    """(base URL, the CA's file) of an HTTPS server with --allowed-origins https://app.example and an API key."""
    root = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_pem.write_to_path(str(root / "key.pem"))
    for blob in cert.cert_chain_pems:
        blob.write_to_path(str(root / "cert.pem"), append=True)
    ca.cert_pem.write_to_path(str(root / "ca.pem"))
    config = ServerConfig(ssl_keyfile=str(root / "key.pem"), ssl_certfile=str(root / "cert.pem"),
                          allowed_origins=[ALLOWED])
    config.validate()
    model = str(write_bigram_llama(root / "llama"))
    engine = AsyncEngine(lambda: LLMEngine(EngineConfig.from_kwargs(model=model, dtype="float32", num_kv_blocks=32)),
                         "m")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, config, None, Tenants.single_key("k")), host="127.0.0.1", port=port,
                                           log_level="warning", timeout_graceful_shutdown=5,
                                           **tls_settings(config)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:  # (uvicorn sets it once it listens; the bound only guards a server that never does)
        assert thread.is_alive() and time.monotonic() < deadline, "the HTTPS server did not start"
        time.sleep(0.05)
    yield f"https://127.0.0.1:{port}", str(root / "ca.pem")
    server.should_exit = True
    thread.join(30)
    engine.shutdown()


def test_the_openai_sdk_completes_over_https_trusting_the_ca_and_refuses_an_unknown_certificate(https_server):
    url, ca = https_server
    with openai.OpenAI(base_url=f"{url}/v1", api_key="k",
                       http_client=httpx.Client(verify=ssl.create_default_context(cafile=ca))) as client:
        completion = client.completions.create(model="m", prompt=[5, 6, 7, 8], max_tokens=3, temperature=0)
    assert completion.usage.completion_tokens == 3
    with openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as untrusting:  # the system's CAs only
        with pytest.raises(openai.APIConnectionError):
            untrusting.completions.create(model="m", prompt=[5, 6, 7, 8], max_tokens=3)


def test_a_preflight_from_an_allowed_origin_gets_cors_headers_and_another_origin_none(https_server):
    url, ca = https_server
    with httpx.Client(verify=ssl.create_default_context(cafile=ca)) as client:
        asked = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        allowed = client.options(f"{url}/v1/completions", headers={"Origin": ALLOWED, **asked})
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ALLOWED
        other = client.options(f"{url}/v1/completions", headers={"Origin": "https://other.example", **asked})
        assert "access-control-allow-origin" not in other.headers
        unauthorised = client.get(f"{url}/v1/models", headers={"Origin": ALLOWED})  # no key: 401, readable by the page
        assert unauthorised.status_code == 401 and unauthorised.headers["access-control-allow-origin"] == ALLOWED


def test_bad_tls_settings_are_refused_naming_the_flag(tmp_path):
    (tmp_path / "key.pem").write_text("")
    for settings, problem in ((dict(ssl_keyfile=str(tmp_path / "key.pem")), "ssl_keyfile and ssl_certfile come together"),
                              (dict(ssl_keyfile=str(tmp_path / "key.pem"), ssl_certfile=str(tmp_path / "missing.pem")),
                               "ssl_certfile .* is not a file"),
                              (dict(ssl_cert_reqs=2), "over HTTPS: give ssl_keyfile"),
                              (dict(allowed_origins=["*"], allow_credentials=True), "name the origins")):
        with pytest.raises(ValueError, match=problem):
            ServerConfig(**settings).validate()
