"""A stand-in for the Hugging Face Hub's HTTP API on loopback: the routes `huggingface_hub` calls to
resolve a revision, list a repository's files and download them (with byte ranges, so an interrupted
download can resume), and the Hub's error codes for a missing repository, revision or file and a
gated repository."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional
from urllib.parse import unquote, urlparse


@dataclass
class FakeRepo:
    """One model repository: its files, its branches (name -> commit) and whether it is gated."""

    files: dict[str, bytes]
    branches: dict[str, str] = field(default_factory=lambda: {"main": "a" * 40})
    gated: bool = False

    @classmethod
    def from_folder(cls, folder: Path, **kwargs) -> "FakeRepo":
        """The files of a folder (not its subfolders)."""
        return cls({p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}, **kwargs)


class FakeHub:
    """The server. `repos` maps 'org/name' to a FakeRepo; `cut_after[name] = (bytes, times)` makes the
    next `times` downloads of file `name` stop after that many bytes, as a dropped connection would;
    `requests` lists what was asked ("GET /path" and, for a byte range, " bytes=N-")."""

    def __init__(self, repos: dict[str, FakeRepo]) -> None:
        self.repos = repos
        self.cut_after: dict[str, tuple[int, int]] = {}
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, head=True)

            def do_GET(self) -> None:
                hub._answer(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()

    # ------------------------------------------------------------------ routes
    def _answer(self, handler: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlparse(handler.path).path)
        ranged = handler.headers.get("range")
        self.requests.append(f"{handler.command} {path}" + (f" {ranged}" if ranged else ""))
        info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", path)
        tree = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if tree:
            self._tree(handler, *tree.groups()[:2])
        elif info:
            self._info(handler, info.group(1), info.group(2) or "main")
        elif resolve:
            self._file(handler, *resolve.groups(), head=head)
        else:
            self._error(handler, 404, "RepoNotFound", "not found")

    def _repo(self, handler, repo_id: str, revision: str) -> Optional[tuple[FakeRepo, str]]:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(handler, 401, "RepoNotFound", f"Repository Not Found for url: {repo_id}")
            return None
        if repo.gated and not handler.headers.get("authorization"):
            self._error(handler, 401, "GatedRepo", f"Access to model {repo_id} is restricted.")
            return None
        commit = repo.branches.get(revision) or (revision if revision in repo.branches.values() else None)
        if commit is None:
            self._error(handler, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo, commit

    def _info(self, handler, repo_id: str, revision: str) -> None:
        found = self._repo(handler, repo_id, revision)
        if found:
            repo, commit = found
            self._json(handler, {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                                 "gated": repo.gated, "siblings": [{"rfilename": name} for name in repo.files]})

    def _tree(self, handler, repo_id: str, revision: str) -> None:
        found = self._repo(handler, repo_id, revision)
        if found:
            repo, _ = found
            self._json(handler, [{"type": "file", "oid": _oid(data), "size": len(data), "path": name}
                                 for name, data in repo.files.items()])

    def _file(self, handler, repo_id: str, revision: str, name: str, head: bool) -> None:
        found = self._repo(handler, repo_id, revision)
        if not found:
            return
        repo, commit = found
        data = repo.files.get(name)
        if data is None:
            self._error(handler, 404, "EntryNotFound", f"{name} does not exist at {revision}")
            return
        start = 0
        ranged = re.fullmatch(r"bytes=(\d+)-", handler.headers.get("range") or "")
        if ranged and not head:
            start = int(ranged.group(1))
        body = data[start:]
        handler.send_response(206 if start else 200)
        handler.send_header("X-Repo-Commit", commit)
        handler.send_header("ETag", f'"{_oid(data)}"')
        handler.send_header("Content-Length", str(len(body)))
        if start:
            handler.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        handler.end_headers()
        if head:
            return
        cut, times = self.cut_after.get(name, (0, 0))
        if times:
            self.cut_after[name] = (cut, times - 1)
            handler.wfile.write(body[:cut])
            handler.wfile.flush()
            handler.close_connection = True
            handler.connection.shutdown(2)
            return
        handler.wfile.write(body)

    @staticmethod
    def _json(handler, value) -> None:
        body = json.dumps(value).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)

    @staticmethod
    def _error(handler, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        handler.send_response(status)
        handler.send_header("X-Error-Code", code)
        handler.send_header("X-Error-Message", message)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)


def _oid(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()
