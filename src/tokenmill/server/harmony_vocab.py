"""openai-harmony's vocabulary file, made from the model's own tokenizer so that harmony never downloads it.

openai-harmony (GPT-OSS's chat format) tokenises with o200k_harmony, whose ordinary tokens are o200k_base's:
it reads them from `o200k_base.tiktoken` (one line per token, `base64(token bytes) rank`, in rank order) and
downloads that file from the internet unless TIKTOKEN_ENCODINGS_BASE names a folder that holds it, in which
case it checks the file's SHA-256 against the one it expects. A GPT-OSS checkpoint's tokenizer.json is a
byte-level BPE of the same vocabulary, id = rank, so its first O200K_TOKENS tokens, turned back into bytes,
are that file byte for byte; tokenmill writes it once under its cache folder and points harmony there.
"""

from __future__ import annotations

import binascii
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

from tokenmill import envs

FILE_NAME = "o200k_base.tiktoken"
O200K_TOKENS = 199_998  # the ordinary tokens; ids from here on are harmony's special and reserved tokens
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # what harmony checks


def _bytes_of_chars() -> dict[int, str]:
    """A str.translate table undoing byte-level BPE's byte -> printable character table (GPT-2's): printable
    Latin-1 bytes stand for themselves, the others for the characters from U+0100 on, in byte order. Each of
    the 256 characters goes to the Latin-1 character of its byte; every other Latin-1 character goes to one
    that Latin-1 cannot encode, so a token that is not byte-level fails to encode (characters past U+0143 are
    left as they are, and fail too)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {code: "\uffff" for code in range(256) if code not in printable}
    extra = 0
    for byte in range(256):
        if byte not in printable:
            table[256 + extra] = chr(byte)
            extra += 1
    return table


def tiktoken_lines(tokenizer: Any) -> bytes:
    """The vocabulary file's bytes for a byte-level BPE `tokenizer` (a transformers tokenizer): its first
    O200K_TOKENS tokens, rank = id; ValueError when it is not byte-level BPE or has fewer tokens. (A
    translate and a Latin-1 encode per token, not a dictionary look-up per character: this runs over 200k
    tokens at a GPT-OSS server's first start.)"""
    if len(tokenizer) < O200K_TOKENS:
        raise ValueError(f"the harmony format needs the o200k vocabulary (GPT-OSS's tokenizer); this tokenizer has "
                         f"{len(tokenizer)} tokens, fewer than o200k's {O200K_TOKENS}")
    table = _bytes_of_chars()
    lines = []
    for rank, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(O200K_TOKENS)))):
        try:
            data = token.translate(table).encode("latin-1")
        except (UnicodeEncodeError, AttributeError):
            raise ValueError(f"the harmony format needs GPT-OSS's byte-level BPE tokenizer; token {rank} of this "
                             f"one ({token!r}) is not byte-level") from None
        lines.append(b"%s %d\n" % (binascii.b2a_base64(data, newline=False), rank))
    return b"".join(lines)


def ensure_vocab_file(tokenizer: Any) -> Path:
    """The folder holding `o200k_base.tiktoken` for harmony, which TIKTOKEN_ENCODINGS_BASE then names: the
    user's folder when the variable is set; else tokenmill's cache, where the file is written from `tokenizer`
    the first time. ValueError when the model's vocabulary is not o200k's (the file's hash differs: harmony
    would tokenise the prompts with another vocabulary than the model's)."""
    configured = envs.tiktoken_encodings_base()
    if configured is not None:
        return configured
    folder = envs.cache_root() / "harmony"
    path = folder / FILE_NAME
    if not (path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == O200K_SHA256):
        data = tiktoken_lines(tokenizer)
        if hashlib.sha256(data).hexdigest() != O200K_SHA256:
            raise ValueError("the harmony format needs the o200k vocabulary (GPT-OSS's tokenizer); this model's "
                             "tokenizer has other tokens, so harmony's prompts would not be its tokens")
        _write_atomically(path, data)
    envs.set_tiktoken_encodings_base(folder)
    return folder


def _write_atomically(path: Path, data: bytes) -> None:
    """`data` into `path` through a temporary file renamed over it: another process reads the whole file or
    none (servers starting side by side share the cache)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def load_encoding(tokenizer: Any) -> Any:
    """openai-harmony's GPT-OSS encoding, its vocabulary read from the file `ensure_vocab_file` provides;
    ValueError naming the missing package when openai-harmony is not installed."""
    try:
        import openai_harmony
    except ImportError:
        raise ValueError("GPT-OSS's chat format needs the openai-harmony package (pip install openai-harmony)") from None
    ensure_vocab_file(tokenizer)
    return openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
