"""GPT-OSS's vocabulary without the internet, and a tiny GPT-OSS that writes a scripted harmony output.

o200k_base's tokens come from the copy of `o200k_base.tiktoken` that the bpe-openai package ships (the file
harmony downloads, the same bytes: harmony checks its hash); harmony's special and reserved tokens follow at
the ids GPT-OSS's tokenizer gives them. Everything here is written straight to disk (no transformers model
class, no tokenizer object: importing GPT-OSS's modelling code and wrapping a 201088-token tokenizer cost
seconds), in the layout of a GPT-OSS checkpoint.
"""

from __future__ import annotations

import binascii
import gzip
import importlib.util
import json
from pathlib import Path

import torch

O200K_TOKENS = 199_998
HARMONY_VOCAB = 201_088  # GPT-OSS's vocab_size: o200k_base, then harmony's special and reserved tokens
HARMONY_SPECIALS = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
                    200003: "<|constrain|>", 200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>",
                    200008: "<|message|>", 200012: "<|call|>"}
# GPT-OSS's layout at the sizes of tests/helpers/tiny_models.py's tiny GPT-OSS: 2 layers (sliding, full),
# 4 query heads of 64 over 2 KV heads, 8 experts of 32 (2 per token), clamped SwiGLU, YaRN, sinks
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, EXPERT_SIZE = 64, 4, 2, 64, 8, 32
CONFIG = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": HARMONY_VOCAB,
    "hidden_size": HIDDEN, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"],
    "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "attention_bias": True,
    "sliding_window": 16, "num_local_experts": EXPERTS, "num_experts_per_tok": 2, "intermediate_size": EXPERT_SIZE,
    "swiglu_limit": 0.6, "hidden_act": "silu", "rms_norm_eps": 1e-05, "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 64, "rope_theta": 150000.0},
    "tie_word_embeddings": False, "bos_token_id": 199998, "eos_token_id": 200002, "pad_token_id": 199999,
    "dtype": "float32"}


def o200k_file() -> bytes:
    """The bytes of o200k_base.tiktoken, from the bpe-openai package's copy, found without importing the
    package (its import builds its own tokenisers: seconds)."""
    spec = importlib.util.find_spec("bpe_openai")
    assert spec is not None and spec.submodule_search_locations, "the tests need the bpe-openai package"
    packed = Path(spec.submodule_search_locations[0]) / "data" / "o200k_base.tiktoken.gz"
    return gzip.decompress(packed.read_bytes())


def o200k_ranks() -> list[bytes]:
    """o200k_base's tokens in rank order."""
    lines = o200k_file().splitlines()
    assert lines[-1].endswith(b" %d" % (len(lines) - 1)), "o200k_base.tiktoken lists its tokens in rank order"
    return [binascii.a2b_base64(line.split(b" ")[0]) for line in lines]


def _byte_level_table() -> dict[int, str]:
    """Byte-level BPE's byte -> printable character table (GPT-2's), as a str.translate table over the
    Latin-1 characters that stand for the bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def write_o200k_tokenizer(dir: Path) -> None:
    """A tokenizer over GPT-OSS's vocabulary in `dir` (tokenizer.json, tokenizer_config.json): o200k_base's
    tokens byte-level encoded at their ranks, harmony's special and reserved tokens after them, as special
    tokens. It decodes as GPT-OSS's does; it has no merges (building them from the ranks costs seconds), so it
    encodes text byte by byte: the harmony path's prompts are harmony's tokens, never this tokenizer's."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    table = _byte_level_table()
    vocab = {token.decode("latin-1").translate(table): rank for rank, token in enumerate(o200k_ranks())}
    specials = [HARMONY_SPECIALS.get(i, f"<|reserved_{i}|>") for i in range(O200K_TOKENS, HARMONY_VOCAB)]
    vocab.update({name: O200K_TOKENS + i for i, name in enumerate(specials)})
    backend = Tokenizer(models.BPE(vocab, [], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    backend.save(str(dir / "tokenizer.json"))
    (dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>", "extra_special_tokens": specials,
        "model_max_length": CONFIG["max_position_embeddings"]}))


def make_scripted_gpt_oss(dir: str | Path, script: list[int], after: int) -> Path:
    """A tiny GPT-OSS (CONFIG: GPT-OSS's vocabulary, hidden 64) whose greedy output after a prompt ending in
    token `after` is `script`, and its o200k tokenizer, in `dir`.

    How: every layer's output projections and expert down projections (weights and biases) are zero, so the
    last position's hidden state is its token's embedding and the model is a bigram table; the embeddings of
    `after` and of the script's tokens are orthonormal directions (RMS-normed to length 8) and each one's
    successor's lm_head row points along it, every other row ~1000x shorter. So the tokens of
    [after] + script[:-1] must be distinct (each has one successor)."""
    chain = [after, *script]
    if len(set(chain[:-1])) != len(chain) - 1 or len(chain) > HIDDEN:
        raise ValueError(f"a scripted output needs distinct tokens (each is one successor's key), at most {HIDDEN - 1}")
    from safetensors.torch import save_file

    path = Path(dir)
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)

    def small(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.1

    tensors = {"model.norm.weight": torch.ones(HIDDEN)}
    for i in range(CONFIG["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        tensors |= {
            layer + "input_layernorm.weight": torch.ones(HIDDEN),
            layer + "post_attention_layernorm.weight": torch.ones(HIDDEN),
            layer + "self_attn.q_proj.weight": small(HEADS * HEAD_DIM, HIDDEN),
            layer + "self_attn.q_proj.bias": small(HEADS * HEAD_DIM),
            layer + "self_attn.k_proj.weight": small(KV_HEADS * HEAD_DIM, HIDDEN),
            layer + "self_attn.k_proj.bias": small(KV_HEADS * HEAD_DIM),
            layer + "self_attn.v_proj.weight": small(KV_HEADS * HEAD_DIM, HIDDEN),
            layer + "self_attn.v_proj.bias": small(KV_HEADS * HEAD_DIM),
            layer + "self_attn.o_proj.weight": torch.zeros(HIDDEN, HEADS * HEAD_DIM),
            layer + "self_attn.o_proj.bias": torch.zeros(HIDDEN),
            layer + "self_attn.sinks": small(HEADS),
            layer + "mlp.router.weight": small(EXPERTS, HIDDEN),
            layer + "mlp.router.bias": small(EXPERTS),
            layer + "mlp.experts.gate_up_proj": small(EXPERTS, HIDDEN, 2 * EXPERT_SIZE),
            layer + "mlp.experts.gate_up_proj_bias": small(EXPERTS, 2 * EXPERT_SIZE),
            layer + "mlp.experts.down_proj": torch.zeros(EXPERTS, EXPERT_SIZE, HIDDEN),
            layer + "mlp.experts.down_proj_bias": torch.zeros(EXPERTS, HIDDEN),
        }
    directions = torch.linalg.qr(torch.randn(HIDDEN, HIDDEN, generator=generator))[0].T  # rows: orthonormal
    # uniform, not normal: randn of these 12.9M-entry tables costs a third of a second
    embed = torch.empty(HARMONY_VOCAB, HIDDEN).uniform_(-0.1, 0.1, generator=generator)
    head = torch.empty(HARMONY_VOCAB, HIDDEN).uniform_(-1e-3, 1e-3, generator=generator)  # far below a successor's ~8
    for key, (token, successor) in enumerate(zip(chain, chain[1:])):
        embed[token] = directions[key]
        head[successor] = directions[key]
    tensors["model.embed_tokens.weight"], tensors["lm_head.weight"] = embed, head
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(CONFIG))
    write_o200k_tokenizer(path)
    return path
