"""The routes an RL trainer drives (server/rl_routes.py), on the server's own app in-process over a tiny checkpoint
(no subprocess: ~10 s of start-up for nothing this file checks): without an API key they are refused; with it, a
pause holds new requests outside the engine, a weight update from a second folder runs while paused, and after
/resume the held request is answered by the new weights exactly as a fresh engine on them answers; a checkpoint of
another shape is a 400 and the weights serving stay; a pause in mode abort ends a running request with an error.
Cost: three tiny engines (~1 s)."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

from helpers.rl_checkpoints import write_rl_checkpoints
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.api_server import build_app
from tokenmill.server.tenants import Tenants

KEY = {"Authorization": "Bearer trainer-key"}
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
ENGINE = dict(dtype="float32", quantization="none", num_kv_blocks=64, block_size=4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_rl_checkpoints(tmp_path_factory.mktemp("rl_routes"), seed=9)


def _server(path: str, api_key, **server):
    engine = AsyncEngine(lambda: LLMEngine(EngineConfig.from_kwargs(model=path, **ENGINE)), "policy")
    return engine, TestClient(build_app(engine, ServerConfig(**server), None,
                                            Tenants.single_key(api_key) if api_key else None))


def _complete(client, max_tokens: int = 6) -> dict:
    response = client.post("/v1/completions", headers=KEY, json={
        "model": "policy", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
        "ignore_eos": True})
    return response


def test_the_routes_need_the_api_key(checkpoints):
    engine, client = _server(checkpoints[0], None)
    try:
        for method, path in (("post", "/pause"), ("post", "/resume"), ("get", "/is_paused"),
                             ("post", "/reset_prefix_cache")):
            response = getattr(client, method)(path)
            assert response.status_code == 403 and "--api-key" in response.json()["error"]["message"]
        response = client.post("/update_weights_from_disk", json={"model_path": checkpoints[1]})
        assert response.status_code == 403
        assert client.post("/collective_rpc", json={"method": "num_layers"}).status_code == 403
        for path, body in (("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                            "rank_offset": 1, "world_size": 2}),
                           ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}),
                           ("/destroy_weights_update_group", {})):
            assert client.post(path, json=body).status_code == 403
    finally:
        engine.shutdown()


def test_pause_update_resume_answers_the_held_request_with_the_new_weights(checkpoints):
    old, new, narrower = checkpoints
    engine, client = _server(old, "trainer-key")
    loop = engine._engine_loop
    try:
        assert client.post("/pause", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get("/is_paused", headers=KEY).json() == {"is_paused": False}
        before = _complete(client).json()["choices"][0]
        assert client.post("/pause?mode=sideways", headers=KEY).status_code == 400
        assert client.post("/pause?mode=wait&clear_cache=true", headers=KEY).json() == {
            "is_paused": True, "prefix_cache_reset": True}
        held: dict = {}
        waiting = threading.Thread(target=lambda: held.update(response=_complete(client)))
        waiting.start()
        while not loop._held and waiting.is_alive():  # the request arrives, and waits outside the engine
            waiting.join(0.01)
        assert list(loop._held) and client.get("/is_paused", headers=KEY).json() == {"is_paused": True}
        refused = client.post("/update_weights_from_disk", headers=KEY, json={"model_path": narrower})
        assert refused.status_code == 400 and "served ones are unchanged" in refused.json()["error"]["message"]
        updated = client.post("/update_weights_from_disk", headers=KEY, json={"model_path": new})
        assert updated.status_code == 200 and updated.json()["success"] is True
        assert client.post("/resume", headers=KEY).json() == {"is_paused": False}
        waiting.join()
        after = held["response"].json()["choices"][0]
        fresh = LLM(new, **ENGINE).generate([{"prompt_token_ids": PROMPT}], SamplingParams(
            temperature=0, max_tokens=6, ignore_eos=True, logprobs=1), use_tqdm=False)[0].outputs[0]
        assert after["text"] == fresh.text != before["text"]
        assert after["logprobs"]["token_logprobs"] == [step[t].logprob for step, t in zip(fresh.logprobs,
                                                                                         fresh.token_ids)]
        assert client.post("/reset_prefix_cache", headers=KEY).json() == {"success": True}
        refused = client.post("/collective_rpc", headers=KEY, json={"method": "execute"})
        assert refused.status_code == 400 and "not a method of the worker extension class" in refused.text
    finally:
        engine.shutdown()


def test_a_pause_in_mode_abort_ends_the_running_request(checkpoints):
    engine, client = _server(checkpoints[0], "trainer-key")
    loop = engine._engine_loop
    try:
        # the engine thread held between commands, so the request enters the engine and is kept there (mode keep)
        # before any step runs: it cannot finish before the pause that aborts it
        gate, gated, kept = threading.Event(), threading.Event(), threading.Event()
        loop.submit(lambda: (gated.set(), gate.wait()))
        gated.wait()
        running: dict = {}
        thread = threading.Thread(target=lambda: running.update(response=_complete(client, max_tokens=100)))
        thread.start()
        while not loop._commands.qsize() and thread.is_alive():  # its admission is queued behind the gate
            thread.join(0.01)
        loop.submit(lambda: loop.pause("keep", kept))
        gate.set()
        kept.wait()
        assert list(loop._streams) and not loop._held  # in the engine, unfinished, not stepped
        assert client.post("/pause?mode=abort", headers=KEY).json() == {"is_paused": True}
        thread.join()
        response = running["response"]
        assert response.status_code >= 400 and "paused (mode abort)" in response.json()["error"]["message"]
        client.post("/resume", headers=KEY)
        assert _complete(client).status_code == 200
    finally:
        engine.shutdown()


def test_sleep_routes_with_enable_sleep_mode(checkpoints):
    engine, client = _server(checkpoints[0], "trainer-key", enable_sleep_mode=True)
    try:
        before = _complete(client).json()["choices"][0]["text"]
        assert client.get("/is_sleeping", headers=KEY).json() == {"is_sleeping": False}
        assert client.post("/sleep?level=5", headers=KEY).status_code == 400
        asleep = client.post("/sleep?level=1", headers=KEY).json()
        assert asleep["is_sleeping"] is True and asleep["kv_pool_bytes_released"] > 0
        refused = _complete(client)
        assert refused.status_code == 400 and "asleep" in refused.json()["error"]["message"]
        assert client.post("/wake_up?tags=kv_cache", headers=KEY).json() == {"is_sleeping": False}
        assert _complete(client).json()["choices"][0]["text"] == before
    finally:
        engine.shutdown()
    engine, client = _server(checkpoints[0], "trainer-key")  # without --enable-sleep-mode: no such routes
    try:
        assert client.post("/sleep", headers=KEY).status_code == 404
    finally:
        engine.shutdown()


def test_weight_group_routes_answer_bad_input_in_the_api_shape(checkpoints):
    """(The transfer itself, from a trainer process, is tests/models/test_weight_updates.py's.)"""
    engine, client = _server(checkpoints[0], "trainer-key")
    try:
        response = client.post("/update_weights_from_distributed", headers=KEY,
                               json={"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[4, 4]]})
        assert response.status_code == 400 and "init_weights_update_group first" in response.json()["error"]["message"]
        response = client.post("/init_weights_update_group", headers=KEY, json={
            "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 2, "world_size": 2})
        assert response.status_code == 400 and response.json()["error"]["param"] == "rank_offset"
        assert client.post("/destroy_weights_update_group", headers=KEY, json={}).status_code == 400
        assert _complete(client).status_code == 200  # and the server serves on
    finally:
        engine.shutdown()
