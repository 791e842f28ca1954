"""The LoRA adapters an engine serves, by name: checked when added, numbered, and unloaded from the
runner once no request uses them."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any, Iterable, Optional

from tokenmill.lora.adapter_config import AdapterConfig
from tokenmill.lora.request import LoRARequest
from tokenmill.lora.weights import projection_shapes, read_adapter


class LoRARegistry:
    """Adapters by name (at most `max_loaded`), each checked against the model `arch` when added. Safe to
    change from the server's thread while the engine thread steps (one lock)."""

    def __init__(self, arch: Any, max_rank: int, max_loaded: int) -> None:
        if arch.mla is not None or arch.moe is not None or arch.keeps_recurrent_state:
            raise ValueError(f"enable_lora: LoRA adapters run on dense attention and MLP layers; "
                             f"{arch.architecture} has latent attention, mixtures of experts or recurrent mixers")
        self.arch, self.max_rank, self.max_loaded = arch, max_rank, max_loaded
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._retired: list[int] = []  # removed adapters' ids, until no request uses them
        self._lock = threading.Lock()

    def add(self, name: str, path: str, lora_int_id: Optional[int] = None) -> LoRARequest:
        """Register the PEFT adapter at `path` as `name`; ValueError if the name is taken, the registry is
        full, or the adapter cannot run on this model (rank above max_lora_rank, unknown targets, shapes)."""
        folder = str(Path(path).expanduser().resolve())
        config = AdapterConfig.read(folder, self.max_rank)
        read_adapter(folder, config, projection_shapes(self.arch), self.arch.num_hidden_layers, shapes_only=True)
        with self._lock:
            if name in self.adapters:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
            if len(self.adapters) >= self.max_loaded:
                raise ValueError(f"{len(self.adapters)} LoRA adapters are loaded, the most this server holds "
                                 f"(--max-cpu-loras); unload one first")
            taken = {a.lora_int_id for a in self.adapters.values()} | set(self._retired)
            if lora_int_id is None or lora_int_id in taken:
                lora_int_id = next(i for i in self._ids if i not in taken)
            adapter = LoRARequest(name, lora_int_id, folder)
            self.adapters[name] = adapter
            return adapter

    def resolve(self, request: LoRARequest) -> LoRARequest:
        """The registered adapter a caller's LoRARequest names, registering it on first use."""
        known = self.adapters.get(request.lora_name)
        if known is not None:
            if Path(known.lora_path) != Path(request.lora_path).expanduser().resolve():
                raise ValueError(f"a LoRA adapter named {request.lora_name!r} is loaded from {known.lora_path}, "
                                 f"not {request.lora_path}")
            return known
        return self.add(request.lora_name, request.lora_path, request.lora_int_id)

    def remove(self, name: str) -> None:
        """Stop serving `name` (KeyError if unknown); the runner frees it once no request uses it."""
        with self._lock:
            adapter = self.adapters.pop(name)
            self._retired.append(adapter.lora_int_id)

    def get(self, name: Optional[str]) -> Optional[LoRARequest]:
        """The adapter registered as `name`, if any."""
        with self._lock:
            return self.adapters.get(name) if name is not None else None

    def listing(self) -> list[LoRARequest]:
        """The adapters, in the order they were added."""
        with self._lock:
            return list(self.adapters.values())

    def take_unloads(self, in_use: Iterable[int]) -> list[int]:
        """Removed adapters no live request uses any more (the runner frees them)."""
        busy = set(in_use)
        with self._lock:
            free = [i for i in self._retired if i not in busy]
            self._retired = [i for i in self._retired if i in busy]
        return free
