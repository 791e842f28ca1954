"""Stored Responses under --state-dir (server/durable_state.py): a new store on the same folder (a restarted
server) continues what the old one stored, bounded as in memory; a corrupted database is moved aside with a log
line and the store starts empty; and through the server's own app, a conversation goes on across a restart."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from tokenmill.server.response_store import ResponseStore
from tokenmill.server.serving_common import APIError


def _turn(index: int) -> tuple[dict, list]:
    return {"id": f"resp_{index}", "object": "response"}, [{"role": "user", "content": f"turn {index}"}]


def test_a_restarted_store_continues_the_newest_conversations(tmp_path):
    store = ResponseStore(3, str(tmp_path))
    for index in range(4):
        store.put(*_turn(index))
    assert store.delete("resp_3") and not store.delete("resp_3")
    store.put(*_turn(3))
    again = ResponseStore(3, str(tmp_path))  # the server restarted (or was killed: every put is committed)
    assert again.continued("resp_2") == [{"role": "user", "content": "turn 2"}]
    assert again.found("resp_3").response == {"id": "resp_3", "object": "response"}
    with pytest.raises(APIError, match="dropped as the oldest of the 3"):
        again.continued("resp_0")
    assert ResponseStore(2, str(tmp_path)).found("resp_2") and not ResponseStore(1, str(tmp_path)).delete("resp_2")


@pytest.mark.parametrize("durable", [False, True])
def test_the_store_is_bounded_by_bytes_too_oldest_first(tmp_path, durable, caplog):
    store = ResponseStore(100, str(tmp_path) if durable else None, max_bytes=300)
    for index in range(4):  # ~107 bytes each: two fit
        store.put({"id": f"resp_{index}", "text": "x" * 40}, [{"role": "user", "content": "y" * 20}])
    with pytest.raises(APIError, match="dropped as the oldest"):
        store.continued("resp_1")
    assert store.found("resp_2") and store.found("resp_3")
    store.put({"id": "resp_big", "text": "z" * 400}, [])  # larger than the whole store: not kept (said), the rest stay
    assert "resp_big was not kept" in caplog.text
    with pytest.raises(APIError):
        store.found("resp_big")
    if durable:  # a restart with a smaller byte bound drops the oldest at once
        assert ResponseStore(100, str(tmp_path), max_bytes=150).found("resp_3")
        with pytest.raises(APIError):
            ResponseStore(100, str(tmp_path)).found("resp_2")


def test_a_database_of_the_first_version_gets_its_sizes(tmp_path):
    import sqlite3

    db = sqlite3.connect(tmp_path / "state.sqlite3", isolation_level=None)
    db.execute("CREATE TABLE responses (id TEXT PRIMARY KEY, seq INTEGER NOT NULL, response TEXT NOT NULL, "
               "conversation TEXT NOT NULL)")
    db.execute("INSERT INTO responses VALUES ('resp_old', 1, '{\"id\": \"resp_old\"}', '[]')")
    db.close()
    store = ResponseStore(10, str(tmp_path), max_bytes=1000)
    assert store.found("resp_old").response == {"id": "resp_old"}
    assert store._shelf.db.execute("SELECT bytes FROM responses").fetchone()[0] == len('{"id": "resp_old"}') + 2


def test_a_corrupted_database_is_moved_aside_and_the_store_starts_empty(tmp_path, caplog):
    (tmp_path / "state.sqlite3").write_bytes(b"not a database, " * 512)
    with caplog.at_level(logging.ERROR):
        store = ResponseStore(5, str(tmp_path))
    assert "could not be read" in caplog.text and "moved aside" in caplog.text
    assert [p.name.split("-")[0] for p in tmp_path.glob("state.sqlite3.corrupt-*")] == ["state.sqlite3.corrupt"]
    store.put(*_turn(1))
    assert ResponseStore(5, str(tmp_path)).found("resp_1")


def test_a_conversation_goes_on_across_a_server_restart(tmp_path):
    from helpers.agreeing_drafts import write_bigram_llama
    from tokenmill.config import EngineConfig, ServerConfig
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.server.api_server import build_app

    model = str(write_bigram_llama(tmp_path / "llama"))
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"

    def serve():
        engine = AsyncEngine(lambda: LLMEngine(EngineConfig.from_kwargs(model=model, dtype="float32",
                                                                        num_kv_blocks=64)), "m")
        return engine, TestClient(build_app(engine, ServerConfig(state_dir=str(tmp_path / "state")), template))

    engine, client = serve()
    first = client.post("/v1/responses", json={"model": "m", "input": "hello there", "max_output_tokens": 4,
                                               "temperature": 0, "store": True}).json()
    engine.shutdown()
    engine, client = serve()  # a new server on the same --state-dir
    try:
        follow = client.post("/v1/responses", json={"model": "m", "input": "and then?", "max_output_tokens": 4,
                                                    "temperature": 0, "previous_response_id": first["id"]})
        alone = client.post("/v1/responses", json={"model": "m", "input": "and then?", "max_output_tokens": 4,
                                                   "temperature": 0})
        assert follow.status_code == 200 and alone.status_code == 200
        # the earlier turn is part of the prompt: its tokens count
        assert follow.json()["usage"]["input_tokens"] > alone.json()["usage"]["input_tokens"] + 4
        assert client.get(f"/v1/responses/{first['id']}").json()["id"] == first["id"]
    finally:
        engine.shutdown()


class _Adapters:
    """A LoRA registry that checks nothing but a path named 'gone' (which no longer loads)."""

    def __init__(self) -> None:
        self.adapters: dict[str, str] = {}

    def add(self, name: str, path: str) -> None:
        if path.endswith("gone"):
            raise ValueError(f"no adapter at {path}")
        self.adapters[name] = path

    def remove(self, name: str) -> None:
        del self.adapters[name]

    def get(self, name):
        return self.adapters.get(name)

    def listing(self) -> list:
        return []


def test_adapters_loaded_at_run_time_are_loaded_again_after_a_restart(tmp_path, caplog):
    from fastapi import FastAPI

    from tokenmill.server.durable_state import SqliteAdapters
    from tokenmill.server.lora_routes import ServedModels, add_lora_routes

    def serve() -> tuple[_Adapters, TestClient]:
        registry, app = _Adapters(), FastAPI()
        add_lora_routes(app, ServedModels("base", registry), str(tmp_path))
        return registry, TestClient(app)

    _, client = serve()
    for name in ("kept", "dropped", "moved"):
        assert client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": f"/a/{name}"}).status_code == 200
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "dropped"}).status_code == 200
    SqliteAdapters(str(tmp_path)).put("moved", "/a/gone")  # its folder went away while the server was down
    with caplog.at_level(logging.INFO):
        registry, _ = serve()
    assert registry.adapters == {"kept": "/a/kept"}
    assert "no longer loads" in caplog.text and SqliteAdapters(str(tmp_path)).listing() == [("kept", "/a/kept")]
