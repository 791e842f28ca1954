"""OpenAI's Files and Batch API: `POST /v1/files` (multipart, purpose batch), `GET /v1/files[/{id}[/content]]`,
`DELETE /v1/files/{id}`, `POST /v1/batches`, `GET /v1/batches[/{id}]`, `POST /v1/batches/{id}/cancel`.

Files live under `--state-dir` (a temporary folder for the server's life when none is given), at most
`--files-max-mb` in all (413 beyond). A batch reads its input file's lines (OpenAI's batch input format) and runs
them through the server's own routes in-process (server/batch_lines.py), at most `--batch-max-concurrency` at once
so that interactive requests keep most of the engine; its state follows OpenAI's statuses (validating,
in_progress, finalizing, completed, failed, cancelling, cancelled, and expired: a batch not done within its 24 h
completion window stops, its unfinished lines failed with `batch_expired` and what finished kept), with request
counts, the answered lines in `output_file_id` and the failed ones in `error_file_id`. One bad line never stops the
others. With `--state-dir`, batches and the output line of each input line they finished are kept in the state
database (server/durable_state.py) as each line finishes: a restarted server runs every batch that had not ended
again from the lines it had not finished, as the tenant that made it (a tenant no longer in the tenants file fails
its batch). Without one they are kept in memory and a restart forgets them.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from fastapi import FastAPI, File, Form, UploadFile
from fastapi.responses import Response

from tokenmill.server.batch_lines import BATCH_URLS, BatchLine, output_line, parse_line, run_lines
from tokenmill.server.protocol import _Strict
from tokenmill.server.serving_common import APIError
from tokenmill.server.tenants import current_tenant

if TYPE_CHECKING:
    from tokenmill.server.durable_state import SqliteBatches

logger = logging.getLogger(__name__)

COMPLETION_WINDOW_S = 24 * 3600  # the one completion window OpenAI offers, "24h"
ENDED = ("completed", "failed", "cancelled", "expired")


class CreateBatchRequest(_Strict):
    """POST /v1/batches."""

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: Optional[dict[str, str]] = None


class FileStore:
    """Uploaded and produced files, each `<id>` (bytes) beside `<id>.json` (its OpenAI file object), in `root`
    (None: a temporary folder made on first use), at most `max_bytes` in all. A tenant's files are its own: they
    lie in `root`/tenants/<name> (tenant names are folder-safe: server/tenants.py), and another tenant's id is
    not found."""

    def __init__(self, root: Optional[Path], max_bytes: int) -> None:
        self._root, self.max_bytes = root, max_bytes

    @property
    def root(self) -> Path:
        """The store's folder, made on first use."""
        if self._root is None:
            import tempfile

            self._root = Path(tempfile.mkdtemp(prefix="tokenmill-files-"))
        self._root.mkdir(parents=True, exist_ok=True)
        return self._root

    @property
    def folder(self) -> Path:
        """The folder of the request's tenant (the root on a server without tenants)."""
        tenant = current_tenant.get()
        if tenant is None:
            return self.root
        folder = self.root / "tenants" / tenant.name
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def used_bytes(self) -> int:
        """The bytes the stored files of every tenant hold."""
        return sum(json.loads(path.read_text())["bytes"] for path in self.root.rglob("file-*.json"))

    def add(self, filename: str, purpose: str, data: bytes) -> dict[str, Any]:
        """Store `data`; its file object. APIError 413 when the store would hold more than its bound."""
        if self.used_bytes() + len(data) > self.max_bytes:
            raise APIError(413, f"the file store holds at most {self.max_bytes >> 20} MiB (--files-max-mb); delete "
                                "files first", param="file")
        file_id = f"file-{uuid.uuid4().hex}"
        (self.folder / file_id).write_bytes(data)
        card = {"id": file_id, "object": "file", "bytes": len(data), "created_at": int(time.time()),
                "filename": filename, "purpose": purpose}
        (self.folder / f"{file_id}.json").write_text(json.dumps(card))
        return card

    def get(self, file_id: str) -> dict[str, Any]:
        """A file's object; APIError 404 for an unknown id."""
        card = self.folder / f"{file_id}.json"
        if not file_id.startswith("file-") or "/" in file_id or not card.is_file():
            raise APIError(404, f"no file {file_id!r}", "not_found_error", "file_id")
        return json.loads(card.read_text())

    def content(self, file_id: str) -> bytes:
        """A file's bytes."""
        self.get(file_id)
        return (self.folder / file_id).read_bytes()

    def delete(self, file_id: str) -> None:
        """Forget a file."""
        self.get(file_id)
        (self.folder / file_id).unlink()
        (self.folder / f"{file_id}.json").unlink()

    def listing(self) -> list[dict[str, Any]]:
        """Every file's object, newest first."""
        return sorted((json.loads(p.read_text()) for p in self.folder.glob("*.json")),
                      key=lambda card: card["created_at"], reverse=True)


class Batches:
    """The batches and the tasks running them over `app` (the server's own app); with a `shelf`, also those of the
    server's earlier lives, kept in the state database (`resume` runs the unfinished ones again)."""

    def __init__(self, app: Any, files: FileStore, max_concurrency: int, window_s: float = COMPLETION_WINDOW_S,
                 shelf: Optional["SqliteBatches"] = None) -> None:
        self.app, self.files, self.max_concurrency, self.window_s = app, files, max_concurrency, window_s
        self.batches: dict[str, dict[str, Any]] = {}
        self.owners: dict[str, Optional[str]] = {}  # batch id -> the tenant that made it (None: no tenants)
        self.tasks: dict[str, asyncio.Task] = {}
        self.shelf = shelf
        for batch, owner in shelf.listing() if shelf is not None else ():
            self.batches[batch["id"]], self.owners[batch["id"]] = batch, owner

    def _save(self, batch: dict[str, Any]) -> None:
        if self.shelf is not None:
            self.shelf.put(batch, self.owners[batch["id"]])

    def create(self, body: CreateBatchRequest) -> dict[str, Any]:
        """A new batch, validating then running in the background."""
        if body.endpoint not in BATCH_URLS:
            raise APIError(400, f"endpoint must be one of {', '.join(BATCH_URLS)}, got {body.endpoint!r}",
                           param="endpoint")
        if body.completion_window != "24h":
            raise APIError(400, f"completion_window must be 24h, got {body.completion_window!r}",
                           param="completion_window")
        self.files.get(body.input_file_id)
        now = int(time.time())
        batch = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": body.endpoint, "errors": None,
                 "input_file_id": body.input_file_id, "completion_window": "24h", "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": now + int(self.window_s), "finalizing_at": None, "completed_at": None, "failed_at": None,
                 "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": body.metadata}
        self.batches[batch["id"]] = batch
        self.owners[batch["id"]] = _tenant_name()
        self._save(batch)
        # the task runs in a copy of this request's context: its lines are the tenant's (server/tenant_gate.py)
        self._start(batch, {}, contextvars.copy_context())
        return batch

    def _start(self, batch: dict[str, Any], finished: dict[int, dict[str, Any]], context: contextvars.Context) -> None:
        task = asyncio.get_running_loop().create_task(self._run(batch, finished), context=context)

        def settle(task: asyncio.Task) -> None:
            if task.cancelled() and batch["status"] != "cancelling":
                return  # the server is shutting down: a kept batch resumes when it starts again
            _settle(batch)
            self._save(batch)
        task.add_done_callback(settle)
        self.tasks[batch["id"]] = task

    def resume(self, gate: Any) -> None:
        """Run every kept batch that had not ended again, from the input lines it had not finished, in a context of
        its own tenant's (`gate`: the server's TenantGate, None without tenants); a batch whose tenant is no longer
        served fails. Called on the event loop as the server starts."""
        from tokenmill.server.tenant_gate import act_as

        for batch_id, batch in self.batches.items():
            if batch["status"] in ENDED:
                continue
            owner, context = self.owners[batch_id], contextvars.copy_context()
            if owner is not None:
                budget = None if gate is None else gate.budgets.get(owner)
                if budget is None:
                    batch["status"], batch["failed_at"] = "failed", int(time.time())
                    batch["errors"] = {"object": "list", "data": [{"code": "batch_failed", "message": f"its tenant "
                                                                   f"'{owner}' is no longer served"}]}
                    self._save(batch)
                    continue
                context.run(act_as, budget)
            finished = self.shelf.lines(batch_id)
            logger.info("resuming batch %s: %d of its lines had finished before the restart", batch_id, len(finished))
            self._start(batch, finished, context)

    def get(self, batch_id: str) -> dict[str, Any]:
        """A batch's object; APIError 404 for an unknown id."""
        if batch_id not in self.batches or self.owners[batch_id] != _tenant_name():
            raise APIError(404, f"no batch {batch_id!r}", "not_found_error", "batch_id")
        return self.batches[batch_id]

    def listing(self) -> list[dict[str, Any]]:
        """The request's tenant's batches, newest first."""
        tenant = _tenant_name()
        return sorted((b for i, b in self.batches.items() if self.owners[i] == tenant), key=lambda b: b["created_at"],
                      reverse=True)

    def cancel(self, batch_id: str) -> dict[str, Any]:
        """Stop a batch: the lines not finished are dropped (those in the engine aborted); what finished is kept."""
        batch = self.get(batch_id)
        if batch["status"] in ("validating", "in_progress"):
            batch["status"], batch["cancelling_at"] = "cancelling", int(time.time())
            self._save(batch)
            self.tasks[batch_id].cancel()
        return batch

    async def _run(self, batch: dict[str, Any], finished: dict[int, dict[str, Any]]) -> None:
        """Run the batch's lines but those `finished` before (by line number, their output lines), then write its
        output and error files. Cancelled by `cancel` (status cancelling): what finished is kept; cancelled
        otherwise (the server shutting down): the batch stays as it is, to resume."""
        answered, failed = [], []

        def write(result: dict[str, Any]) -> None:
            response = result["response"]
            (answered if response is not None and response["status_code"] == 200 else failed).append(result)
            batch["request_counts"] = {"total": batch["request_counts"]["total"], "completed": len(answered),
                                       "failed": len(failed)}

        def keep(line: BatchLine, result: dict[str, Any]) -> None:
            finished[line.number] = result
            response = result["response"]
            if self.shelf is not None and (response is None or response["status_code"] != 503):
                # (a 503: the server was shutting down under the line; it runs again after the restart; the batch's
                # counts are not saved with each line: a resumed batch counts its kept lines again)
                self.shelf.add_line(batch["id"], line.number, result)
        for result in finished.values():
            write(result)
        try:
            text = self.files.content(batch["input_file_id"]).decode("utf-8", errors="replace")
            lines = [_for_endpoint(parse_line(n, t), batch["endpoint"]) for n, t in enumerate(text.splitlines(), 1)
                     if t.strip()]
            batch["request_counts"]["total"] = len(lines)
            if batch["status"] in ("validating", "in_progress"):
                batch["status"], batch["in_progress_at"] = "in_progress", batch["in_progress_at"] or int(time.time())
                self._save(batch)
                todo = [line for line in lines if line.number not in finished]
                try:
                    await asyncio.wait_for(run_lines(self.app, todo, write, self.max_concurrency, done=keep),
                                           max(0.0, batch["expires_at"] - time.time()))
                except asyncio.TimeoutError:  # past the completion window: what did not finish fails as expired
                    failed += [output_line(line.custom_id, error={"code": "batch_expired", "message": "the batch's "
                                                                  "completion window ended before this line ran"})
                               for line in lines if line.number not in finished]
                    batch["request_counts"]["failed"] = len(failed)
                    batch["status"], batch["expired_at"] = "expired", int(time.time())
                else:
                    batch["status"], batch["finalizing_at"] = "finalizing", int(time.time())
                self._save(batch)
        except asyncio.CancelledError:
            if batch["status"] != "cancelling":
                raise
        except Exception as exc:  # the batch's own failure (its file unreadable): no line ran
            batch["status"], batch["failed_at"] = "failed", int(time.time())
            batch["errors"] = {"object": "list", "data": [{"code": "batch_failed", "message": str(exc)}]}
            return
        for name, results in (("output_file_id", answered), ("error_file_id", failed)):
            if results:
                data = "".join(json.dumps(r) + "\n" for r in results).encode()
                batch[name] = self.files.add(f"{batch['id']}_{name.split('_')[0]}.jsonl", "batch_output", data)["id"]
        if batch["status"] == "cancelling":
            batch["status"], batch["cancelled_at"] = "cancelled", int(time.time())
        elif batch["status"] != "expired":
            batch["status"], batch["completed_at"] = "completed", int(time.time())


def _settle(batch: dict[str, Any]) -> None:
    """After a batch's task, whatever became of it: a batch cancelled before its task began is cancelled now, one
    whose task broke off otherwise has failed (each status ends the batch)."""
    if batch["status"] == "cancelling":
        batch["status"], batch["cancelled_at"] = "cancelled", int(time.time())
    elif batch["status"] not in ("completed", "failed", "cancelled", "expired"):
        batch["status"], batch["failed_at"] = "failed", int(time.time())


def _for_endpoint(line: BatchLine, endpoint: str) -> BatchLine:
    """A line whose url is not its batch's endpoint is refused (OpenAI runs one endpoint a batch)."""
    if line.problem is None and line.url != endpoint:
        return BatchLine(line.number, line.custom_id, problem=f"line {line.number}: url {line.url!r} is not this "
                                                              f"batch's endpoint {endpoint!r}")
    return line


def add_batch_routes(app: FastAPI, files: FileStore, batches: Batches) -> None:
    """The Files and Batch routes on `app`."""

    @app.post("/v1/files")
    async def create_file(file: UploadFile = File(...), purpose: str = Form(...)) -> dict[str, Any]:
        if purpose != "batch":
            raise APIError(400, f"purpose must be batch (the files this server runs), got {purpose!r}",
                           param="purpose")
        data = await file.read(files.max_bytes + 1)
        return files.add(file.filename or "upload.jsonl", purpose, data)

    @app.get("/v1/files")
    async def list_files() -> dict[str, Any]:
        return {"object": "list", "data": files.listing()}

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str) -> dict[str, Any]:
        return files.get(file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> Response:
        return Response(files.content(file_id), media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> dict[str, Any]:
        files.delete(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches")
    async def create_batch(body: CreateBatchRequest) -> dict[str, Any]:
        return batches.create(body)

    @app.get("/v1/batches")
    async def list_batches() -> dict[str, Any]:
        data = batches.listing()
        return {"object": "list", "data": data, "has_more": False,
                "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str) -> dict[str, Any]:
        return batches.get(batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> dict[str, Any]:
        return batches.cancel(batch_id)


def add_batch_api(app: FastAPI, state_dir: Optional[str], files_max_mb: int, max_concurrency: int) -> None:
    """The Files and Batch API on `app`, its files under `state_dir` (a temporary folder when None), batches posting
    to `app` itself, as the tenant that made them (the batches: app.state.batches)."""
    if files_max_mb < 1 or max_concurrency < 1:
        raise ValueError(f"files_max_mb and batch_max_concurrency must be >= 1, got {files_max_mb} and "
                         f"{max_concurrency}")
    files = FileStore(Path(state_dir) / "files" if state_dir is not None else None, files_max_mb << 20)
    shelf = None
    if state_dir is not None:
        from tokenmill.server.durable_state import SqliteBatches

        shelf = SqliteBatches(state_dir)
    app.state.batches = batches = Batches(app, files, max_concurrency, shelf=shelf)
    add_batch_routes(app, files, batches)
    app.router.on_startup.append(lambda: batches.resume(getattr(app.state, "tenant_gate", None)))


def _tenant_name() -> Optional[str]:
    tenant = current_tenant.get()
    return None if tenant is None else tenant.name
