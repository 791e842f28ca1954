"""Fast tokenizers for HF folders and GGUF files, with GGUF conversions cached on disk.

transformers needs seconds to build a tokenizer from GGUF metadata, so the result is saved with
`save_pretrained` under `$TOKENMILL_CACHE_DIR/tokenizers/<key>` (default `~/.cache/tokenmill`)
and reloaded from there; the key changes whenever the GGUF file's path, size or mtime does. The conversion
itself is AutoTokenizer's without its full parse of the file (gguf_tokenizer.py), or AutoTokenizer's own where
that cannot tell which class AutoTokenizer would pick.

For an HF folder, AutoTokenizer picks the tokenizer's class from the folder's config, and reading the
config imports transformers' model code for the architecture: about a second per process, more than a
small tokenizer takes to load. The class it picked is remembered under
`$TOKENMILL_CACHE_DIR/tokenizer-classes/<key>`, the key a hash of everything the choice reads (the
transformers version, the folder's file names and its config and tokenizer files); a later load of the
same files imports that class from its own module and calls its `from_pretrained`, as AutoTokenizer does
once it has picked. For the common class (TokenizersBackend) that never imports `transformers.models`,
whose package scans every model's source files when imported (about a second of CPU per process: every
server and other process that loads a tokenizer paid it).

Within a process, the second load of the same folder's files (engines built one after another, as tests and
benchmarks do) keeps an untouched copy of the tokenizer it built, and later loads get deep copies of it: 0.2 s
instead of 0.7 s for a 49k-token tokenizer, and every caller still owns its own object.
"""

from __future__ import annotations

import copy
import fnmatch
import hashlib
import importlib
import json
import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from tokenmill import envs
from tokenmill.models.loader.gguf_tokenizer import UnsupportedGGUFTokenizer, load_gguf_tokenizer_directly

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

def gguf_tokenizer_cache_dir(gguf_path: str | Path) -> Path:
    """The folder where the tokenizer converted from `gguf_path` is (or will be) cached."""
    path = Path(gguf_path).resolve()
    stat = path.stat()
    identity = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return envs.cache_root() / "tokenizers" / f"{path.stem}-{key}"


# the files whose bytes AutoTokenizer's choice of class reads (besides the names of all the folder's files)
_CLASS_CHOICE_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json",
                       "tokenizer.model", "tekken.json", "params.json")


# the folders' identities loaded once in this process, and the untouched copies of those loaded again (bounded)
_LOADED_ONCE: OrderedDict[tuple, None] = OrderedDict()
_UNTOUCHED: OrderedDict[tuple, "PreTrainedTokenizerBase"] = OrderedDict()
_MAX_REMEMBERED, _MAX_UNTOUCHED = 64, 4


def load_hf_tokenizer(folder: str | Path) -> "PreTrainedTokenizerBase":
    """The tokenizer saved in an HF checkpoint folder: AutoTokenizer's, by the class it picked for the same
    files before where the cache remembers it; a deep copy of an untouched one where this process loaded the
    same files twice before (see the module docstring). The caller owns the object it gets."""
    from transformers import PreTrainedTokenizerFast

    identity = _files_identity(Path(folder))
    untouched = _UNTOUCHED.get(identity) if identity else None
    if untouched is not None:
        _UNTOUCHED.move_to_end(identity)
        return copy.deepcopy(untouched)
    tokenizer = _load_hf_tokenizer(folder)
    if identity and isinstance(tokenizer, PreTrainedTokenizerFast):  # a fast one copies in full
        if identity in _LOADED_ONCE:
            _UNTOUCHED[identity] = copy.deepcopy(tokenizer)
            if len(_UNTOUCHED) > _MAX_UNTOUCHED:
                _UNTOUCHED.popitem(last=False)
        _LOADED_ONCE[identity] = None
        if len(_LOADED_ONCE) > _MAX_REMEMBERED:
            _LOADED_ONCE.popitem(last=False)
    return tokenizer


def _files_identity(folder: Path) -> Optional[tuple]:
    """The folder's path and each of its files' name, size and modification time: what changes when anything a
    tokenizer could read there changes; None where the folder cannot be listed."""
    try:
        folder = folder.resolve()
        entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
        return (str(folder), *((entry.name, entry.stat().st_size, entry.stat().st_mtime_ns) for entry in entries))
    except OSError:
        return None


def _load_hf_tokenizer(folder: str | Path) -> "PreTrainedTokenizerBase":
    record = _class_record(Path(folder))
    remembered = _remembered_class(record, Path(folder)) if record is not None else None
    if remembered is not None:
        return remembered.from_pretrained(str(folder))
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import MODEL_IDS_TO_TOKENIZERS_BACKEND, tokenizer_class_from_name

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    chosen = type(tokenizer)
    overrides = list(MODEL_IDS_TO_TOKENIZERS_BACKEND)
    if (record is not None and not _named_by_an_override(Path(folder), overrides)
            and tokenizer_class_from_name(chosen.__name__) is chosen):  # not remote code
        _write_text_atomically(record, json.dumps({"module": chosen.__module__, "class": chosen.__name__,
                                                   "hub_id_overrides": overrides}))
    return tokenizer


def _class_record(folder: Path) -> Optional[Path]:
    """Where the class AutoTokenizer picks for `folder`'s files is remembered (see _remembered_class)."""
    import transformers

    digest = hashlib.sha256(transformers.__version__.encode() + _RECORD_FORMAT)
    try:
        digest.update("\0".join(sorted(os.listdir(folder))).encode())
        for name in _CLASS_CHOICE_FILES:
            if (folder / name).is_file():
                digest.update(b"\0" + name.encode() + b"\0" + (folder / name).read_bytes())
    except OSError:
        return None
    return envs.cache_root() / "tokenizer-classes" / digest.hexdigest()[:32]


# in the record's key: a record of another format (an older tokenmill's) is another file, never misread
_RECORD_FORMAT = b"\0module-class-overrides"


def _remembered_class(record: Path, folder: Path) -> Optional[type]:
    """The class the record names, imported from its module; None where there is no readable record, the
    class is not transformers' own, or the folder's path is one of the Hub ids that transformers overrides
    by name (the record keeps that list as the transformers version of its key had it, so checking it needs no
    import of transformers.models)."""
    try:
        remembered = json.loads(record.read_text())
        module_name, class_name = remembered["module"], remembered["class"]
        overrides = list(remembered["hub_id_overrides"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not module_name.startswith("transformers.") or _named_by_an_override(folder, overrides):
        return None
    try:
        chosen = getattr(importlib.import_module(module_name), class_name, None)
    except ImportError:
        return None
    return chosen if isinstance(chosen, type) else None


def _named_by_an_override(folder: Path, patterns: list[str]) -> bool:
    """Whether transformers picks the class by the path itself (a few Hub ids) rather than by the files."""
    return any(fnmatch.fnmatch(str(folder).lower(), pattern) for pattern in patterns)


def _write_text_atomically(target: Path, text: str) -> None:
    """Write `text` to `target` by a rename, so a reader sees all of it or nothing; a cache that cannot be
    written is skipped (the next load asks AutoTokenizer again)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=target.parent, prefix=f".{target.name}-", delete=False) as out:
            out.write(text)
        os.replace(out.name, target)
    except OSError:
        pass


def _save_atomically(tokenizer: "PreTrainedTokenizerBase", target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tokenizer.save_pretrained(str(staging))
        os.replace(staging, target)
    except OSError:
        if not target.exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_gguf_tokenizer(gguf_path: str | Path) -> "PreTrainedTokenizerBase":
    """The tokenizer described by a GGUF file's metadata, converted once and then cached."""
    cached = gguf_tokenizer_cache_dir(gguf_path)
    if cached.is_dir():
        return load_hf_tokenizer(cached)
    try:
        tokenizer = load_gguf_tokenizer_directly(gguf_path)
    except UnsupportedGGUFTokenizer:
        tokenizer = _auto_gguf_tokenizer(Path(gguf_path).resolve())
    _save_atomically(tokenizer, cached)
    return tokenizer


def _auto_gguf_tokenizer(path: Path) -> "PreTrainedTokenizerBase":
    """AutoTokenizer's tokenizer for the GGUF file at `path` (the slow way: see gguf_tokenizer.py)."""
    from transformers import AutoTokenizer  # imports transformers.models: only to convert

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except ValueError as exc:
        if "is not supported" not in str(exc):
            raise
        # transformers reads GGUF configs of some architectures only (not OLMoE's), but converts any
        # file's tokenizer metadata: build the tokenizer without the config
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
