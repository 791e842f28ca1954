"""A copy of a GGUF file without its tokenizer's vocabulary arrays, for HF transformers to load as the oracle.

transformers reads a GGUF file's metadata through gguf-py element by element, twice (config, then weights):
for a vocabulary of 262k tokens that costs far more than dequantising the weights. The model needs none of
it but the vocabulary's size. The copy keeps every other metadata entry and every tensor byte for byte
(this reads and writes raw bytes; nothing here interprets a value the engine under test also reads) and adds
`<architecture>.vocab_size`, the number of entries of `tokenizer.ggml.tokens`, which transformers otherwise
takes from that array.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import shutil
import struct
from pathlib import Path

# the arrays the copy leaves out: the model's weights and config do not depend on them
DROPPED = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
_STRING, _ARRAY, _UINT32 = 8, 9, 4


def _skip_value(data, offset: int, kind: int) -> int:
    """The offset just past a value of GGUF type `kind` that starts at `offset`."""
    if kind in _SCALAR_SIZES:
        return offset + _SCALAR_SIZES[kind]
    if kind == _STRING:
        (length,) = struct.unpack_from("<Q", data, offset)
        return offset + 8 + length
    if kind == _ARRAY:
        element, count = struct.unpack_from("<IQ", data, offset)
        offset += 12
        if element in _SCALAR_SIZES:
            return offset + count * _SCALAR_SIZES[element]
        for _ in range(count):
            offset = _skip_value(data, offset, element)
        return offset
    raise ValueError(f"unknown GGUF value type {kind}")


def _string(data, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", data, offset)
    return data[offset + 8:offset + 8 + length].decode(), offset + 8 + length


def _entry(key: str, kind: int, value: bytes) -> bytes:
    name = key.encode()
    return struct.pack("<Q", len(name)) + name + struct.pack("<I", kind) + value


def write_without_vocabulary(source: str | Path, target: str | Path) -> Path:
    """Write the copy of GGUF file `source` at `target` (a path ending in .gguf) and return `target`."""
    source, target = Path(source), Path(target)
    with open(source, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as head:
        header, data_start, alignment = _header_without_vocabulary(head, source)
    with open(source, "rb") as file, open(target, "wb") as out:
        out.write(header + bytes(-len(header) % alignment))
        file.seek(data_start)
        shutil.copyfileobj(file, out, 16 << 20)  # the tensors' offsets count from the data section's start
    return target


def _header_without_vocabulary(head, source: Path) -> tuple[bytes, int, int]:
    """The copy's header (metadata and tensor table), where the source's data section starts and the
    alignment."""
    magic, version, num_tensors, num_entries = struct.unpack_from("<4sIQQ", head, 0)
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"{source} is not a GGUF file of version 2 or later")
    offset, kept, values = 24, [], {}
    for _ in range(num_entries):
        start = offset
        key, offset = _string(head, offset)
        (kind,) = struct.unpack_from("<I", head, offset)
        end = _skip_value(head, offset + 4, kind)
        if key == "tokenizer.ggml.tokens":
            values["vocabulary"] = struct.unpack_from("<IQ", head, offset + 4)[1]
        elif key == "general.architecture":
            values[key] = _string(head, offset + 4)[0]
        elif key == "general.alignment":
            values[key] = struct.unpack_from("<I", head, offset + 4)[0]
        if key not in DROPPED:
            kept.append((key, head[start:end]))
        offset = end
    table_start = offset
    for _ in range(num_tensors):
        _, offset = _string(head, offset)
        (dims,) = struct.unpack_from("<I", head, offset)
        offset += 4 + 8 * dims + 4 + 8  # the dimensions, the type and the offset in the data section
    table = head[table_start:offset]
    alignment = values.get("general.alignment", 32)
    data_start = -(-offset // alignment) * alignment
    vocab_key = f"{values['general.architecture']}.vocab_size"
    if "vocabulary" in values and all(key != vocab_key for key, _ in kept):
        kept.append((vocab_key, _entry(vocab_key, _UINT32, struct.pack("<I", values["vocabulary"]))))
    header = struct.pack("<4sIQQ", magic, version, num_tensors, len(kept)) + b"".join(raw for _, raw in kept) + table
    return header, data_start, alignment


def hf_float32_model(gguf_path: str | Path, folder: Path):
    """HF transformers' float32 model of GGUF file `gguf_path`, dequantised by transformers itself, loaded from a
    copy without the vocabulary arrays written in `folder` (and removed once the weights are in memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    copy = write_without_vocabulary(gguf_path, Path(folder) / Path(gguf_path).name)
    try:
        with _tensor_name_maps_built_once(), _dequantised_in_larger_groups():
            return AutoModelForCausalLM.from_pretrained(copy.parent, gguf_file=copy.name, dtype=torch.float32).eval()
    finally:
        copy.unlink()


@contextlib.contextmanager
def _tensor_name_maps_built_once():
    """transformers asks gguf-py for the same (architecture, layers) name map once per module of the model, and
    each costs tens of milliseconds to build (~10 s for a 30-layer model). The map is a read-only lookup table,
    so one per key serves every call; gguf-py's own function is put back afterwards."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


# output values per group of rows that gguf-py dequantises at once, instead of its 16 rows (the same values bit for
# bit: every block of a row decodes on its own). Measured on Gemma 3 270M's weights: 7.2 s of transformers'
# load in gguf-py's 16-row groups, most of it numpy's calls on small arrays
_GROUP_VALUES = 1 << 18


@contextlib.contextmanager
def _dequantised_in_larger_groups():
    """transformers dequantises each tensor through gguf-py, which runs its numpy decoding of blocks over groups of
    16 rows. This has gguf-py's own decoding (its `dequantize_rows`, the oracle's arithmetic, untouched) run over
    groups of about _GROUP_VALUES values; gguf-py's grouping is put back afterwards."""
    import numpy as np
    from gguf import quants

    original = quants._apply_over_grouped_rows

    def larger_groups(func, arr, otype, oshape):
        rows = arr.reshape((-1, arr.shape[-1]))
        out = np.empty(shape=int(np.prod(oshape)), dtype=otype).reshape((rows.shape[0], -1))
        per_group = max(1, _GROUP_VALUES // max(1, out.shape[1]))
        for first in range(0, rows.shape[0], per_group):
            out[first:first + per_group] = func(rows[first:first + per_group]).reshape((-1, out.shape[1]))
        return out.reshape(oshape)

    quants._apply_over_grouped_rows = larger_groups
    try:
        yield
    finally:
        quants._apply_over_grouped_rows = original
