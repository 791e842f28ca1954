"""The routes an RL trainer drives between rollouts, under vLLM's and SGLang's names: `POST /pause?mode=abort|wait|
keep&clear_cache=`, `POST /resume`, `GET /is_paused`, `POST /reset_prefix_cache`, `POST
/update_weights_from_disk` ({"model_path": ...}), and the weight-update group a trainer streams tensors over
(`POST /init_weights_update_group`, `/update_weights_from_distributed`, `/destroy_weights_update_group`). They
change what the server serves, so each needs the server's API key: a server started without `--api-key` answers
them 403 (vLLM leaves them open).

Pausing: new requests wait outside the engine until `/resume` (bounded as the waiting queue); mode abort ends the
requests in the engine (failed, saying why), wait lets them finish first, keep leaves them where they are to go on
after `/resume` (on the old K/V: a weight update refuses to run while they exist). A weight update runs on the
engine thread between steps (engine/llm_engine.py's update_weights_from_disk).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from fastapi import FastAPI, Query

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.engine_errors import WeightTransferError
from tokenmill.server.protocol import _Strict
from tokenmill.server.serving_common import APIError
from tokenmill.server.tenants import require_admin

PAUSE_MODES = ("abort", "wait", "keep")


class CollectiveRpcRequest(_Strict):
    """POST /collective_rpc (vLLM's): a method of the worker extension class and its JSON arguments."""

    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class InitWeightsUpdateGroupRequest(_Strict):
    """POST /init_weights_update_group (SGLang's shape): the trainer is rank 0 and serves the rendezvous."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: Optional[str] = None  # gloo on CPU, nccl on CUDA
    timeout_seconds: float = 120.0  # (tokenmill's) the longest the rendezvous may wait for the other ranks


class UpdateWeightsFromDistributedRequest(_Strict):
    """POST /update_weights_from_distributed (SGLang's shape): one broadcast tensor per name, in order."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True  # SGLang's; the prefix cache is always forgotten (the old weights computed it)
    load_format: Optional[str] = None


class DestroyWeightsUpdateGroupRequest(_Strict):
    """POST /destroy_weights_update_group (SGLang's shape)."""

    group_name: str = "weight_update_group"


class UpdateWeightsFromDiskRequest(_Strict):
    """POST /update_weights_from_disk (SGLang's shape)."""

    model_path: str
    load_format: Optional[str] = None  # SGLang's; the checkpoint's own format is read ("auto")


def add_rl_routes(app: FastAPI, engine: AsyncEngine, sleep_mode: bool = False) -> None:
    """The routes above on `app`, each for admin tenants only (server/tenants.py), and with `sleep_mode`
    (--enable-sleep-mode) vLLM's sleep routes."""

    def guarded() -> None:
        require_admin("this route changes the weights or the state the server serves")

    async def reset() -> bool:
        return await engine.call(lambda e: e.reset_prefix_cache())

    @app.post("/pause")
    async def pause(mode: str = "abort", clear_cache: bool = False) -> dict[str, Any]:
        guarded()
        if mode not in PAUSE_MODES:
            raise APIError(400, f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", param="mode")
        await engine.pause(mode)
        answer: dict[str, Any] = {"is_paused": True}
        if clear_cache:
            answer["prefix_cache_reset"] = await reset()  # (false in mode keep: the kept requests hold blocks)
        return answer

    @app.post("/resume")
    async def resume() -> dict[str, bool]:
        guarded()
        engine.resume()
        return {"is_paused": False}

    @app.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        guarded()
        return {"is_paused": engine.is_paused}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, bool]:
        guarded()
        if not await reset():
            raise APIError(409, "requests hold cached blocks: pause with mode abort or wait (or let them finish) "
                                "before resetting the prefix cache", "conflict_error")
        return {"success": True}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest) -> dict[str, Any]:
        guarded()
        if body.load_format not in (None, "auto"):
            raise APIError(400, f"load_format {body.load_format!r}: the checkpoint's own format is read (auto)",
                           param="load_format")
        copied = await _weight_call(engine, "model_path", lambda e: e.update_weights_from_disk(body.model_path))
        return {"success": True, "message": f"weights updated from {body.model_path} ({copied} bytes copied in "
                                            "place); prefix cache reset"}

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitWeightsUpdateGroupRequest) -> dict[str, Any]:
        guarded()
        await _weight_call(engine, "rank_offset", lambda e: e.init_weights_update_group(
            body.master_address, body.master_port, body.rank_offset, body.world_size, body.group_name, body.backend,
            body.timeout_seconds))
        return {"success": True, "message": f"joined weight-update group {body.group_name!r} as rank "
                                            f"{body.rank_offset} of {body.world_size}"}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedRequest) -> dict[str, Any]:
        guarded()
        if body.load_format not in (None, "auto"):
            raise APIError(400, f"load_format {body.load_format!r}: tensors are received as sent", param="load_format")
        copied = await _weight_call(engine, "names", lambda e: e.update_weights_from_distributed(
            body.names, body.dtypes, body.shapes, body.group_name))
        return {"success": True, "message": f"{len(body.names)} tensors received ({copied} bytes copied in place); "
                                            "prefix cache reset"}

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupRequest) -> dict[str, Any]:
        guarded()
        if not await engine.call(lambda e: e.destroy_weights_update_group(body.group_name)):
            raise APIError(400, f"no weight-update group {body.group_name!r} is joined", param="group_name")
        return {"success": True, "message": f"left weight-update group {body.group_name!r}"}

    @app.post("/collective_rpc")
    async def collective_rpc(body: CollectiveRpcRequest) -> dict[str, Any]:
        guarded()
        try:
            results = await engine.call(lambda e: e.collective_rpc(body.method, tuple(body.args), body.kwargs))
        except ValueError as exc:
            raise APIError(400, str(exc), param="method") from None
        return {"results": results}

    if not sleep_mode:
        return

    @app.post("/sleep")
    async def sleep(level: int = 1) -> dict[str, Any]:
        guarded()
        try:
            memory = await engine.call(lambda e: e.sleep(level))
        except ValueError as exc:
            unfinished = "unfinished" in str(exc)
            raise APIError(409 if unfinished else 400, str(exc), "conflict_error" if unfinished
                           else "invalid_request_error", None if unfinished else "level") from None
        return {"is_sleeping": True, **memory}

    @app.post("/wake_up")
    async def wake_up(tags: Optional[list[str]] = Query(None)) -> dict[str, bool]:
        guarded()
        try:
            await engine.call(lambda e: e.wake_up(tags))
        except ValueError as exc:
            raise APIError(400, str(exc), param="tags") from None
        return {"is_sleeping": await engine.call(lambda e: e.is_sleeping)}

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        guarded()
        return {"is_sleeping": await engine.call(lambda e: e.is_sleeping)}


async def _weight_call(engine: AsyncEngine, param: str, call: Callable[[Any], Any]) -> Any:
    """`call` on the engine thread, its errors as the API's: 409 while requests are unfinished, 400 naming `param`
    for bad input, 502 when a trainer's transfer broke (the served weights unchanged in every case)."""
    try:
        return await engine.call(call)
    except ValueError as exc:
        unfinished = "requests are unfinished" in str(exc)
        raise APIError(409 if unfinished else 400, str(exc), "conflict_error" if unfinished
                       else "invalid_request_error", None if unfinished else param) from None
    except WeightTransferError as exc:
        raise APIError(502, str(exc), "weight_transfer_error") from None
