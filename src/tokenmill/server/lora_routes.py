"""LoRA adapters over HTTP, as vLLM serves them: `--lora-modules`, `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter`, and the `model` of a request naming an adapter."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Optional

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from tokenmill.engine.lora_registry import LoRARegistry
from tokenmill.lora.request import LoRARequest
from tokenmill.server.protocol import _Strict
from tokenmill.server.serving_common import APIError
from tokenmill.server.tenants import current_tenant

logger = logging.getLogger(__name__)


class LoadLoRAAdapterRequest(_Strict):
    """POST /v1/load_lora_adapter."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter of the same name


class UnloadLoRAAdapterRequest(_Strict):
    """POST /v1/unload_lora_adapter."""

    lora_name: str
    lora_int_id: Optional[int] = None


def parse_lora_modules(modules: Optional[list[str]]) -> list[tuple[str, str]]:
    """(name, path) of each `--lora-modules` entry: name=path, or vLLM's JSON object with name and path."""
    parsed = []
    for entry in modules or []:
        if entry.lstrip().startswith("{"):
            try:
                value = json.loads(entry)
                parsed.append((str(value["name"]), str(value["path"])))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"lora_modules: {entry!r} is not JSON with 'name' and 'path'") from None
        elif "=" in entry:
            name, path = entry.split("=", 1)
            parsed.append((name.strip(), path.strip()))
        else:
            raise ValueError(f"lora_modules: {entry!r} is neither name=path nor JSON")
    return parsed


class ServedModels:
    """The names a server answers to: its base model and the LoRA adapters registered now."""

    def __init__(self, base_name: str, loras: Optional[LoRARegistry]) -> None:
        self.base_name, self.loras = base_name, loras

    def adapter(self, name: Optional[str]) -> Optional[LoRARequest]:
        """The adapter a request's `model` names (None: the base model); a 404 listing every served name for
        a name this server does not serve."""
        if name is None or name == self.base_name:
            return None
        adapter = self.loras.get(name) if self.loras is not None else None
        if adapter is None:
            names = ", ".join(repr(n) for n in [self.base_name, *self.adapter_names()])
            raise APIError(404, f"The model '{name}' does not exist; this server serves {names}.",
                           "not_found_error", "model")
        return adapter

    def adapter_names(self) -> list[str]:
        """The registered adapters' names."""
        return [a.lora_name for a in self.loras.listing()] if self.loras is not None else []

    def cards(self, created: int, base_card: dict[str, Any]) -> list[dict[str, Any]]:
        """/v1/models' entries: the base model, then each adapter (vLLM's `root` and `parent`)."""
        cards = [{"id": self.base_name, "object": "model", "created": created, "owned_by": "tokenmill",
                  "root": self.base_name, "parent": None, **base_card}]
        for adapter in (self.loras.listing() if self.loras is not None else []):
            cards.append({"id": adapter.lora_name, "object": "model", "created": created, "owned_by": "tokenmill",
                          "root": adapter.lora_path, "parent": self.base_name, **base_card})
        return cards


def add_lora_routes(app: FastAPI, models: ServedModels, state_dir: Optional[str] = None) -> None:
    """vLLM's runtime adapter routes (400 naming the problem; 404 for an unknown name). With `state_dir`, the
    adapters they load are remembered in the state database and loaded again when a server starts on it (one that
    no longer loads is forgotten, with a log line)."""
    remembered = None
    if state_dir is not None and models.loras is not None:
        from tokenmill.server.durable_state import SqliteAdapters

        remembered = SqliteAdapters(state_dir)
        for name, path in remembered.listing():
            try:
                models.loras.add(name, path)
                logger.info("LoRA adapter %r loaded again from %s (loaded at run time before a restart)", name, path)
            except ValueError as exc:
                remembered.delete(name)
                logger.error("LoRA adapter %r, loaded at run time before a restart, no longer loads (%s): forgotten",
                             name, exc)

    def registry() -> LoRARegistry:
        tenant = current_tenant.get()
        if tenant is not None and not tenant.admin:
            raise APIError(403, f"loading and unloading adapters changes what every tenant is served: tenant "
                                f"'{tenant.name}' is not an admin tenant", "permission_error")
        if models.loras is None:
            raise APIError(400, "this server serves no LoRA adapters (start it with --enable-lora)", param="lora_name")
        return models.loras

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        loras = registry()
        if body.lora_name == models.base_name:
            raise APIError(400, f"'{body.lora_name}' is the base model's name", param="lora_name")
        if body.load_inplace and loras.get(body.lora_name) is not None:
            loras.remove(body.lora_name)
        try:
            await asyncio.to_thread(loras.add, body.lora_name, body.lora_path)
        except ValueError as exc:
            raise APIError(400, str(exc), param="lora_path" if "already" not in str(exc) else "lora_name") from None
        if remembered is not None:
            remembered.put(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        loras = registry()
        try:
            loras.remove(body.lora_name)
        except KeyError:
            raise APIError(404, f"no LoRA adapter named '{body.lora_name}' is loaded; loaded: "
                                f"{', '.join(models.adapter_names()) or 'none'}", "not_found_error",
                           "lora_name") from None
        if remembered is not None:
            remembered.delete(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
