"""What a server keeps across restarts under `--state-dir`: one SQLite database (the standard library's sqlite3, WAL
mode, `state.sqlite3`) of its stored Responses, each with its size in bytes, of the LoRA adapters loaded at run
time (by name and path), which a restarted server loads again, and of its Batch API batches with the output line of
each input line they finished, so a restarted server resumes a batch where it stopped. Every write is committed
before the request that made it is answered, so a server killed at any moment keeps every response it has answered
with. A database that cannot be opened or read (a corrupted file) is moved aside, with a log line, and the server
starts with an empty one.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)

DATABASE = "state.sqlite3"


def open_database(folder: str) -> sqlite3.Connection:
    """The state database under `folder` (made if missing), its tables ready; a file that is no readable SQLite
    database is renamed `state.sqlite3.corrupt-<time>` first. (Made where the app is built, used on the event loop:
    one thread at a time, so the connection may cross threads.)"""
    path = Path(folder) / DATABASE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return _ready(sqlite3.connect(path, isolation_level=None, check_same_thread=False))
    except sqlite3.DatabaseError as exc:
        aside = path.with_name(f"{DATABASE}.corrupt-{int(time.time())}")
        for suffix in ("", "-wal", "-shm"):
            if Path(f"{path}{suffix}").exists():
                Path(f"{path}{suffix}").rename(f"{aside}{suffix}")
        logger.error("the state database %s could not be read (%s): moved aside to %s; starting with an empty one",
                     path, exc, aside)
        return _ready(sqlite3.connect(path, isolation_level=None, check_same_thread=False))


def _ready(connection: sqlite3.Connection) -> sqlite3.Connection:
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, seq INTEGER NOT NULL, "
                       "response TEXT NOT NULL, conversation TEXT NOT NULL, bytes INTEGER NOT NULL DEFAULT 0)")
    connection.execute("CREATE TABLE IF NOT EXISTS adapters (name TEXT PRIMARY KEY, path TEXT NOT NULL)")
    connection.execute("CREATE TABLE IF NOT EXISTS batches (id TEXT PRIMARY KEY, owner TEXT, batch TEXT NOT NULL)")
    connection.execute("CREATE TABLE IF NOT EXISTS batch_lines (batch_id TEXT NOT NULL, line INTEGER NOT NULL, "
                       "result TEXT NOT NULL, PRIMARY KEY (batch_id, line))")
    connection.execute("SELECT count(*) FROM responses").fetchone()  # (reads a page: a corrupted file fails here)
    if "bytes" not in {row[1] for row in connection.execute("PRAGMA table_info(responses)")}:  # an older database
        connection.execute("ALTER TABLE responses ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0")
        connection.execute("UPDATE responses SET bytes = length(CAST(response AS BLOB)) + "
                           "length(CAST(conversation AS BLOB))")
    return connection


class SqliteResponses:
    """Stored responses in the state database, oldest first by insertion (the `ResponseStore`'s shelf)."""

    def __init__(self, folder: str) -> None:
        self.db = open_database(folder)

    def put(self, response_id: str, response: dict[str, Any], conversation: list[dict[str, Any]], size: int) -> None:
        """Store (or replace, as the newest) the response and its conversation, counted as `size` bytes; committed
        on return."""
        self.db.execute("INSERT OR REPLACE INTO responses VALUES (?, (SELECT coalesce(max(seq), 0) + 1 FROM "
                        "responses), ?, ?, ?)", (response_id, json.dumps(response), json.dumps(conversation), size))

    def get(self, response_id: str) -> Optional[tuple[dict[str, Any], list[dict[str, Any]]]]:
        """(response, conversation), or None."""
        row = self.db.execute("SELECT response, conversation FROM responses WHERE id = ?", (response_id,)).fetchone()
        return None if row is None else (json.loads(row[0]), json.loads(row[1]))

    def delete(self, response_id: str) -> bool:
        """Drop one; False when it was not stored."""
        return self.db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def keep_newest(self, count: int, max_bytes: int) -> int:
        """Drop the oldest until at most `count` are kept, holding at most `max_bytes`; how many were dropped."""
        kept, held = 0, 0
        for seq, size in self.db.execute("SELECT seq, bytes FROM responses ORDER BY seq DESC"):
            if kept + 1 > count or held + size > max_bytes:
                return self.db.execute("DELETE FROM responses WHERE seq <= ?", (seq,)).rowcount
            kept, held = kept + 1, held + size
        return 0


class SqliteAdapters:
    """The LoRA adapters loaded at run time (POST /v1/load_lora_adapter), by name, in the state database."""

    def __init__(self, folder: str) -> None:
        self.db = open_database(folder)

    def put(self, name: str, path: str) -> None:
        """Remember (or replace) an adapter; committed on return."""
        self.db.execute("INSERT OR REPLACE INTO adapters VALUES (?, ?)", (name, path))

    def delete(self, name: str) -> None:
        """Forget an adapter."""
        self.db.execute("DELETE FROM adapters WHERE name = ?", (name,))

    def listing(self) -> list[tuple[str, str]]:
        """(name, path) of every adapter remembered, by name."""
        return list(self.db.execute("SELECT name, path FROM adapters ORDER BY name"))


class SqliteBatches:
    """Batch API batches (their OpenAI objects and the tenant that made each: None on a server without tenants) and
    the output line of each input line they finished (by line number), in the state database."""

    def __init__(self, folder: str) -> None:
        self.db = open_database(folder)

    def put(self, batch: dict[str, Any], owner: Optional[str]) -> None:
        """Store (or replace) a batch's object; committed on return."""
        self.db.execute("INSERT OR REPLACE INTO batches VALUES (?, ?, ?)", (batch["id"], owner, json.dumps(batch)))

    def add_line(self, batch_id: str, line: int, result: dict[str, Any]) -> None:
        """Remember the output line of input line `line` (from 1); committed on return."""
        self.db.execute("INSERT OR REPLACE INTO batch_lines VALUES (?, ?, ?)", (batch_id, line, json.dumps(result)))

    def lines(self, batch_id: str) -> dict[int, dict[str, Any]]:
        """The output lines the batch finished, by input line number."""
        return {line: json.loads(result) for line, result in
                self.db.execute("SELECT line, result FROM batch_lines WHERE batch_id = ? ORDER BY line", (batch_id,))}

    def listing(self) -> list[tuple[dict[str, Any], Optional[str]]]:
        """(batch, owner) of every batch stored, oldest first."""
        return [(json.loads(batch), owner) for batch, owner in
                self.db.execute("SELECT batch, owner FROM batches ORDER BY rowid")]
