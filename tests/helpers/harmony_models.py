"""GPT-OSS's vocabulary without the internet, and a tiny GPT-OSS that writes a scripted harmony output.

o200k_base's tokens come from the copy of `o200k_base.tiktoken` that the bpe-openai package ships (the file
harmony downloads, the same bytes: harmony checks its hash); harmony's special and reserved tokens follow at
the ids GPT-OSS's tokenizer gives them.
"""

from __future__ import annotations

import base64
import functools
import json
import gzip
import importlib.util
from pathlib import Path
from typing import Any

import torch

from helpers.tiny_models import make_tiny_hf_model

O200K_TOKENS = 199_998
HARMONY_VOCAB = 201_088  # GPT-OSS's vocab_size: o200k_base, then harmony's special and reserved tokens
HARMONY_SPECIALS = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
                    200003: "<|constrain|>", 200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>",
                    200008: "<|message|>", 200012: "<|call|>"}


def o200k_file() -> bytes:
    """The bytes of o200k_base.tiktoken, from the bpe-openai package's copy, found without importing the
    package (its import builds its own tokenisers: seconds)."""
    spec = importlib.util.find_spec("bpe_openai")
    assert spec is not None and spec.submodule_search_locations, "the tests need the bpe-openai package"
    packed = Path(spec.submodule_search_locations[0]) / "data" / "o200k_base.tiktoken.gz"
    return gzip.decompress(packed.read_bytes())


def o200k_ranks() -> list[bytes]:
    """o200k_base's tokens in rank order."""
    tokens = []
    for rank, line in enumerate(o200k_file().splitlines()):
        token, number = line.split(b" ")
        assert int(number) == rank
        tokens.append(base64.b64decode(token))
    return tokens


def _char_of_byte() -> dict[int, str]:
    """Byte-level BPE's byte -> printable character table (GPT-2's)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


@functools.lru_cache(maxsize=1)
def o200k_tokenizer() -> Any:
    """A transformers tokenizer over GPT-OSS's vocabulary: o200k_base's tokens byte-level encoded at their
    ranks, harmony's special and reserved tokens after them, as special tokens. It decodes as GPT-OSS's does;
    it has no merges (building them from the ranks costs seconds), so it encodes text byte by byte: the
    harmony path's prompts are harmony's tokens, never this tokenizer's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _char_of_byte()
    vocab = {"".join(chars[b] for b in token): rank for rank, token in enumerate(o200k_ranks())}
    specials = [HARMONY_SPECIALS.get(i, f"<|reserved_{i}|>") for i in range(O200K_TOKENS, HARMONY_VOCAB)]
    vocab.update({name: O200K_TOKENS + i for i, name in enumerate(specials)})
    backend = Tokenizer(models.BPE(vocab, [], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|startoftext|>",
                                        eos_token="<|return|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    return tokenizer


def make_scripted_gpt_oss(dir: str | Path, script: list[int], after: int) -> Path:
    """A tiny GPT-OSS (2 layers, hidden 64, GPT-OSS's vocabulary) whose greedy output after a prompt ending in
    token `after` is `script`, and its o200k tokenizer, in `dir`.

    How: every layer's output projections and expert down projections are zero, so the last position's hidden
    state is its token's embedding and the model is a bigram table; the embeddings of `after` and of the
    script's tokens are orthonormal directions and each one's successor's lm_head row points along it. So the
    tokens of [after] + script[:-1] must be distinct (each has one successor)."""
    chain = [after, *script]
    if len(set(chain[:-1])) != len(chain) - 1 or len(chain) > 64:
        raise ValueError("a scripted output needs distinct tokens (each is one successor's key), at most 63")
    # built with a small vocabulary, then given GPT-OSS's: HF's init of a 201088-row table takes seconds
    path = make_tiny_hf_model(dir, arch="gpt_oss", vocab_size=256)
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    for name, tensor in tensors.items():
        if any(part in name for part in ("o_proj", "experts.down_proj")):
            tensor.zero_()
    generator = torch.Generator().manual_seed(0)
    directions = torch.linalg.qr(torch.randn(64, 64, generator=generator))[0].T  # rows: orthonormal
    embed = torch.randn(HARMONY_VOCAB, 64, generator=generator) * 0.1
    head = torch.randn(HARMONY_VOCAB, 64, generator=generator) * 0.001  # far below a scripted successor's ~8
    for key, (token, successor) in enumerate(zip(chain, chain[1:])):
        embed[token] = directions[key]
        head[successor] = directions[key]
    tensors["model.embed_tokens.weight"], tensors["lm_head.weight"] = embed, head
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vocab_size": HARMONY_VOCAB, "bos_token_id": 199998,
                                                   "eos_token_id": 200002, "pad_token_id": 199999}))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    o200k_tokenizer().save_pretrained(path)
    return path
