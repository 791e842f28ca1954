"""The native kernels built for aarch64 and run under qemu-user, behind the same Python wrappers as on x86.

`make test-arm` runs the kernel tests with `aarch64_kernels()` as their `kernels` (tests/kernels/conftest.py):
the portable C is cross-compiled with aarch64-linux-gnu-gcc (the `generic` level, what an ARM machine builds),
and `CpuKernels` — the wrappers the engine calls — is given a stand-in for its ctypes library whose functions
ship each call to aarch64_call_server.c, which runs under qemu-aarch64 and calls the real aarch64 function. The
tensors a call points into travel there and back whole (their storages), so a kernel's in-place outputs land in
the test's tensors as they would natively; the structures of the fused decode step travel too, their pointers
set to the same places there. Only the kernels run as aarch64 code; PyTorch and the references stay
on the host, which keeps a run to minutes (an arm64 Python with PyTorch under qemu would emulate those too).
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import shutil
import struct
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import torch

from tokenmill import envs
from tokenmill.kernels import build, cpu_kernels, isa

CROSS_COMPILER = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"  # Debian's libc6-arm64-cross, which the cross compiler brings
SERVER_SOURCE = Path(__file__).with_name("aarch64_call_server.c")


class TensorAddress(int):
    """A tensor's data address (what `cpu_kernels._ptr` returns) that remembers its tensor, so a call shipped
    to another process can send the memory it points into. An int, so ctypes libraries take it unchanged."""

    tensor: torch.Tensor


def tensor_address(t: torch.Tensor) -> TensorAddress:
    """`cpu_kernels._ptr` with the tensor kept beside the address."""
    address = TensorAddress(t.data_ptr())
    address.tensor = t
    return address


def missing_tools() -> list[str]:
    """The programs a run needs that are not on PATH (Debian packages gcc-aarch64-linux-gnu, qemu-user)."""
    return [tool for tool in (CROSS_COMPILER, QEMU) if shutil.which(tool) is None]


def _storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _live_storages() -> list[torch.UntypedStorage]:
    """The storages of every live CPU tensor: where the raw addresses models/fused_decode.py puts in its
    structures (data_ptr(), not cpu_kernels._ptr) point. A walk over every object, once per call that needs it."""
    # type(), not isinstance: isinstance reads __class__, which some lazy module proxies answer with a warning
    return [t.untyped_storage() for t in gc.get_objects()
            if issubclass(type(t), torch.Tensor) and t.device.type == "cpu"]


def _pointer_offsets(ctype: Any, base: int = 0) -> Iterator[int]:
    """The byte offsets of every pointer field in a ctypes structure or array type (nested ones included)."""
    if issubclass(ctype, ctypes.Array):
        for i in range(ctype._length_):
            yield from _pointer_offsets(ctype._type_, base + i * ctypes.sizeof(ctype._type_))
    elif issubclass(ctype, ctypes.Structure):
        for name, field_type in ctype._fields_:
            yield from _pointer_offsets(field_type, base + getattr(ctype, name).offset)
    elif ctype is ctypes.c_void_p:
        yield base


class _EncodedCall:
    """One call's regions (the storages it points into, written back after it; the structures it reads) and
    the fix-ups of the pointers inside those structures."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.regions: list[torch.Tensor] = []  # every region's bytes, as uint8 tensors
        self.written_back: list[bool] = []
        self.storage_index: dict[int, int] = {}  # storage address -> region
        self.fixups: list[bytes] = []
        self.live: Optional[list[torch.UntypedStorage]] = None

    def storage_holding(self, address: int) -> torch.UntypedStorage:
        """The storage of a live tensor that holds `address`."""
        if self.live is None:
            self.live = _live_storages()
        for storage in self.live:
            if storage.data_ptr() <= address < storage.data_ptr() + max(storage.nbytes(), 1):
                return storage
        raise TypeError(f"{self.name}: no live tensor holds the address {address:#x} it points to")

    def pointer_to(self, address: int, storage: Optional[torch.UntypedStorage]) -> tuple[int, int]:
        """(region, offset) of `address` in `storage` (None: found among the live tensors)."""
        storage = self.storage_holding(address) if storage is None else storage
        base = storage.data_ptr()
        if base not in self.storage_index:
            self.storage_index[base] = len(self.regions)
            self.regions.append(_storage_bytes(storage))
            self.written_back.append(True)
        return self.storage_index[base], address - base

    def structure(self, value: Any) -> int:
        """The region of a ctypes structure or array, its pointer fields fixed up to their regions."""
        region = len(self.regions)
        data = ctypes.string_at(ctypes.addressof(value), ctypes.sizeof(value))
        self.regions.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.written_back.append(False)  # the kernels only read their structures
        for offset in _pointer_offsets(type(value)):
            address = int.from_bytes(data[offset:offset + 8], "little")
            if address:
                target, target_offset = self.pointer_to(address, None)
                self.fixups.append(struct.pack("<IQIQ", region, offset, target, target_offset))
        return region

    def argument(self, value: Any, kind: Any) -> bytes:
        """One argument, encoded."""
        if kind is ctypes.c_void_p:
            if value is None:
                return b"n"
            if type(value).__name__ == "CArgObject":  # ctypes.byref(structure)
                value = value._obj
            if isinstance(value, (ctypes.Structure, ctypes.Array)):
                return b"p" + struct.pack("<IQ", self.structure(value), 0)
            storage = value.tensor.untyped_storage() if isinstance(value, TensorAddress) else None
            return b"p" + struct.pack("<IQ", *self.pointer_to(int(value), storage))
        if kind is ctypes.c_int64:
            return b"i" + struct.pack("<q", value)
        if kind is ctypes.c_int:
            return b"w" + struct.pack("<i", value)
        if kind is ctypes.c_float:
            return b"f" + struct.pack("<f", value)
        raise TypeError(f"{self.name}: no encoding for {kind}")


class _RemoteFunction:
    """One function of the aarch64 library, called as a ctypes function is (argtypes and restype set by
    CpuKernels)."""

    def __init__(self, library: "QemuLibrary", name: str) -> None:
        self.library, self.name = library, name
        self.argtypes: list[Any] = []
        self.restype: Any = None

    def __call__(self, *args: Any) -> Optional[int]:
        if len(args) != len(self.argtypes):
            raise TypeError(f"{self.name} takes {len(self.argtypes)} arguments, got {len(args)}")
        call = _EncodedCall(self.name)
        encoded = [call.argument(value, kind) for value, kind in zip(args, self.argtypes)]
        name = self.name.encode()
        message = [struct.pack("<I", len(name)), name, struct.pack("<I", len(call.regions))]
        for region in call.regions:
            message += [struct.pack("<Q", region.numel()), region.numpy().tobytes()]
        message += [struct.pack("<I", len(call.fixups)), *call.fixups, struct.pack("<I", len(encoded)), *encoded]
        result, returned = self.library.exchange(b"".join(message), [r.numel() for r in call.regions])
        for region, data, write in zip(call.regions, returned, call.written_back):
            if write:
                region.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if self.restype is ctypes.c_int:
            return ctypes.c_int32(result).value
        return None if self.restype is None else result


class QemuLibrary:
    """A stand-in for `ctypes.CDLL(library)` whose functions run in aarch64_call_server under qemu-aarch64."""

    def __init__(self, library: Path, server: Path) -> None:
        self._functions: dict[str, _RemoteFunction] = {}
        self._lock = threading.Lock()
        self._process = subprocess.Popen([QEMU, "-L", SYSROOT, str(server), str(library)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def __getattr__(self, name: str) -> _RemoteFunction:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._functions:
            self._functions[name] = _RemoteFunction(self, name)
        return self._functions[name]

    def exchange(self, message: bytes, sizes: list[int]) -> tuple[int, list[bytes]]:
        """Send one encoded call; its int64 result and the regions' bytes after it."""
        with self._lock:
            self._process.stdin.write(message)
            self._process.stdin.flush()
            head = self._process.stdout.read(8)
            if len(head) != 8:
                raise RuntimeError(f"the aarch64 process died (exit status {self._process.wait()}); "
                                   "its message is on stderr")
            return struct.unpack("<q", head)[0], [self._process.stdout.read(size) for size in sizes]

    def close(self) -> None:
        """End the aarch64 process."""
        self._process.stdin.close()
        self._process.wait(timeout=60)


def _built_server(folder: Path) -> Path:
    """aarch64_call_server.c compiled for aarch64 into `folder`, named by its source's hash."""
    source = SERVER_SOURCE.read_bytes()
    target = folder / f"aarch64_call_server-{hashlib.sha256(source).hexdigest()[:16]}"
    if not target.exists():
        partial = Path(tempfile.mkdtemp(dir=folder)) / "server"
        subprocess.run([CROSS_COMPILER, "-O2", "-std=c11", "-Wall", "-Werror", "-o", str(partial),
                        str(SERVER_SOURCE), "-ldl"], check=True, capture_output=True, text=True)
        partial.replace(target)
        partial.parent.rmdir()
    return target


def aarch64_library() -> Path:
    """The generic level's library cross-compiled for aarch64, through the kernel cache (build.py names it by
    the compiler, so it never stands in for a native build)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CC", CROSS_COMPILER)
        return build.built_library(isa.GENERIC)


def aarch64_kernels(monkeypatch: pytest.MonkeyPatch) -> tuple[cpu_kernels.CpuKernels, QemuLibrary]:
    """CpuKernels of the generic level whose every call runs the aarch64 library under qemu, and that library
    (close it when done). Replaces `cpu_kernels._ptr` (through `monkeypatch`) by `tensor_address`, which every
    ctypes library also takes."""
    if missing_tools():
        raise RuntimeError(f"{', '.join(missing_tools())} missing: `make test-arm` installs them "
                           "(Debian packages gcc-aarch64-linux-gnu, qemu-user)")
    library = aarch64_library()
    folder = envs.cache_root() / "kernels"
    folder.mkdir(parents=True, exist_ok=True)
    remote = QemuLibrary(library, _built_server(folder))
    monkeypatch.setattr(cpu_kernels, "_ptr", tensor_address)
    return cpu_kernels.CpuKernels(remote, isa.GENERIC), remote
