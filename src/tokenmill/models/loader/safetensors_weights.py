"""Stream the tensors of an HF checkpoint folder: one `model.safetensors` or a sharded set."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_TORCH_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


class SafetensorsWeights:
    """The safetensors files of a folder, read lazily through memory maps, each tensor once."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.names_by_file = self._names_by_file()

    def _names_by_file(self) -> dict[Path, list[str]]:
        index_path = self.folder / INDEX_FILE
        if index_path.exists():
            with open(index_path, encoding="utf-8") as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
            names_by_file: dict[Path, list[str]] = {}
            for name, file_name in weight_map.items():
                names_by_file.setdefault(self.folder / file_name, []).append(name)
            return names_by_file
        single = self.folder / SINGLE_FILE
        if not single.exists():
            raise ValueError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.folder}")
        with _opened(single) as f:
            return {single: list(f.keys())}

    @property
    def names(self) -> list[str]:
        """All tensor names in the checkpoint."""
        return [name for names in self.names_by_file.values() for name in names]

    def dtype_name_of(self, name: str) -> str:
        """The stored dtype of tensor `name` as a torch name ("bfloat16"), from the file header."""
        with _opened(self.file_of(name)) as f:
            stored = f.get_slice(name).get_dtype()
        return _TORCH_DTYPE_NAMES.get(stored, stored.lower())

    def iter_tensors(self, wanted: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(name, tensor)` for every name in `wanted`, file by file, in stored dtype."""
        for path, names in self.names_by_file.items():
            selected = [name for name in names if name in wanted]
            if not selected:
                continue
            with _opened(path) as f:
                for name in selected:
                    try:
                        tensor = f.get_tensor(name)
                    except Exception as error:  # safetensors' own error type, not a ValueError
                        raise ValueError(f"{path}: tensor {name} cannot be read ({error})") from None
                    yield name, tensor

    def file_of(self, name: str) -> Path:
        """The file that holds tensor `name`."""
        for path, names in self.names_by_file.items():
            if name in names:
                return path
        raise ValueError(f"no tensor {name!r} in {self.folder}")


def _opened(path: Path) -> Any:
    """safe_open(path), its errors (a truncated or corrupt file) as a ValueError naming the file."""
    try:
        return safe_open(path, framework="pt")
    except Exception as error:  # safetensors raises its own SafetensorError
        raise ValueError(f"{path} is not a readable safetensors file ({error}); download it again") from None
