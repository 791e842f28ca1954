"""An embedding model loaded from an HF folder: tokenizer, network, pooling; token ids in, vectors out.

Encoders (BertModel and kin, pooling/bert.py) attend both ways over each whole sequence. Decoders run as
the engine's causal decoder (models/decoder.py) over a scratch KV cache made for the step and dropped
after it: an embedding needs one forward pass over the prompt and keeps nothing.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from tokenmill.pooling.pooler_config import ENCODER_ARCHITECTURES, PoolerConfig, is_pooling_model, read_pooler_config

logger = logging.getLogger(__name__)

_SCRATCH_BLOCK = 16  # tokens per block of a decoder's scratch KV cache


def pool(states: torch.Tensor, seq_lens: Sequence[int], method: str) -> torch.Tensor:
    """Token states [T, hidden] of sequences laid end to end -> one float32 vector per sequence [N, hidden]."""
    states = states.float()
    ends = torch.tensor(seq_lens, device=states.device).cumsum(0)
    if method == "cls":
        return states[ends - torch.tensor(seq_lens, device=states.device)]
    if method == "last":
        return states[ends - 1]
    return torch.stack([part.mean(0) for part in states.split(list(seq_lens))])


class EmbeddingModel:
    """Token-id sequences in, one float32 vector each out, pooled and normalised as the model's
    sentence-transformers configuration says. `encode` computes each sequence alike whatever else is
    in the call (the network's rows never mix)."""

    def __init__(self, name: str, tokenizer: Any, network: Callable[[list[list[int]]], torch.Tensor],
                 pooler: PoolerConfig, max_model_len: int, hidden_size: int, vocab_size: int,
                 description: str) -> None:
        self.name, self.tokenizer, self.network, self.pooler = name, tokenizer, network, pooler
        self.max_model_len, self.hidden_size, self.vocab_size = max_model_len, hidden_size, vocab_size
        self.description = description

    def tokenize(self, text: str) -> list[int]:
        """The token ids the model reads for `text` (with its special tokens)."""
        return self.tokenizer(text, add_special_tokens=True).input_ids

    def input_tokens(self, inputs: Sequence[Union[str, Sequence[int]]], truncate: Optional[int] = None,
                     add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each input (a text or token ids). `truncate` k cuts each to its first k tokens
        (-1: the model's limit), with the tokenizer's truncation for texts, which keeps the special tokens
        (as sentence-transformers does). ValueError for a `truncate` out of range."""
        limit = self.max_model_len if truncate == -1 else truncate
        if limit is not None and not 1 <= limit <= self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens must be -1 or in [1, {self.max_model_len}], got {truncate}")
        options = {"truncation": True, "max_length": limit} if limit is not None else {}
        return [self.tokenizer(item, add_special_tokens=add_special_tokens, **options).input_ids
                if isinstance(item, str) else list(item)[:limit] for item in inputs]

    def check_tokens(self, token_ids: Sequence[int]) -> None:
        """ValueError naming the problem if the model cannot take `token_ids` as one input."""
        if not token_ids:
            raise ValueError("an input is empty: give at least one token")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"an input has {len(token_ids)} tokens; this model takes at most "
                             f"{self.max_model_len} (set truncate_prompt_tokens to cut inputs)")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}")

    def check_dimensions(self, dimensions: Optional[int]) -> None:
        """ValueError unless the model can give vectors of `dimensions` (None: its own width)."""
        if dimensions is None:
            return
        if not self.pooler.matryoshka:
            raise ValueError(f"this model's vectors cannot be shortened: it was not trained for it (matryoshka); "
                             f"omit 'dimensions' (its vectors have {self.hidden_size})")
        if not 1 <= dimensions <= self.hidden_size:
            raise ValueError(f"dimensions must be in [1, {self.hidden_size}], got {dimensions}")

    @torch.inference_mode()
    def encode(self, sequences: list[list[int]], dimensions: Optional[int] = None) -> torch.Tensor:
        """float32 [len(sequences), dimensions or hidden]: the sequences' vectors (checked by the caller)."""
        vectors = pool(self.network(sequences), [len(s) for s in sequences], self.pooler.method)
        if dimensions is not None:  # matryoshka: the leading dimensions, normalised again (as vLLM)
            vectors = vectors[:, :dimensions]
        return F.normalize(vectors, p=2, dim=-1) if self.pooler.normalize else vectors


def load_embedding_model(model: str, dtype: str = "auto", device: str = "auto",
                         max_model_len: Optional[int] = None, attention_backend: str = "auto",
                         name: Optional[str] = None, any_decoder: bool = False,
                         location: Optional[dict] = None) -> EmbeddingModel:
    """Load the embedding model in the HF folder `model` (a path or alias); `any_decoder` takes a causal LM
    without sentence-transformers files too (last-token pooling, normalised, as vLLM's default). `dtype`
    auto is float32: embedding models are small, and their users compare vectors to the float reference's
    (bfloat16 measured cosine 0.99990 against it on all-MiniLM-L6-v2)."""
    from tokenmill.worker.model_setup import resolve_device
    from tokenmill.models.loader import load_model_source, resolve_model_path
    from tokenmill.models.loader.tokenizer import load_hf_tokenizer

    path = resolve_model_path(model, **(location or {}))  # location: a Hub model's revision (model_location)
    if not is_pooling_model(path) and not (any_decoder and (Path(path) / "config.json").is_file()):
        raise ValueError(f"{path} is not an embedding model (an encoder such as BertModel, or a folder with "
                         "sentence-transformers modules.json)")
    hf_config = json.loads((Path(path) / "config.json").read_text())
    architectures = hf_config.get("architectures") or []
    encoder = any(a in ENCODER_ARCHITECTURES for a in architectures)
    pooler = read_pooler_config(path, hf_config, encoder)
    torch_device = resolve_device(device)
    torch_dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype)
    if encoder:
        network, positions, width, vocab, description = _load_encoder(path, hf_config, torch_dtype, torch_device)
    else:
        source = load_model_source(path, with_tokenizer=False)
        positions = min(source.arch.max_position_embeddings, max_model_len or source.arch.max_position_embeddings)
        network = _DecoderStates(source, torch_dtype, torch_device, positions, attention_backend)
        width, vocab, description = source.arch.hidden_size, source.arch.vocab_size, network.description
    limits = [n for n in (positions, pooler.max_seq_length, max_model_len) if n is not None]
    return EmbeddingModel(name or path, load_hf_tokenizer(path), network, pooler, min(limits), width, vocab,
                          f"{description}; {pooler.method} pooling{', normalised' if pooler.normalize else ''}")


def _load_encoder(path: str, hf_config: dict[str, Any], dtype: torch.dtype, device: torch.device):
    from tokenmill.kernels.cpu_kernels import cpu_kernels
    from tokenmill.layers.linear_kernels import packing_applies
    from tokenmill.models.loader.safetensors_weights import SafetensorsWeights
    from tokenmill.pooling.bert import BertEncoder

    with torch.device(device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            encoder = BertEncoder(hf_config)
        finally:
            torch.set_default_dtype(previous)
    weights = SafetensorsWeights(path)
    encoder.load_weights(weights.iter_tensors(set(weights.names)))
    native = cpu_kernels() if device.type == "cpu" else None
    encoder.use_linear_kernels(packing_applies(dtype, device), native, batch_invariant=True)
    encoder.eval()

    def network(sequences: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
        return encoder(ids, [len(s) for s in sequences])

    return (network, encoder.max_positions, hf_config["hidden_size"], hf_config["vocab_size"],
            f"{hf_config.get('model_type', 'bert')} encoder, {dtype}")


class _DecoderStates:
    """A causal decoder's final states for whole sequences, through a KV cache made for the call."""

    def __init__(self, source: Any, dtype: torch.dtype, device: torch.device, max_model_len: int,
                 attention_backend: str) -> None:
        from tokenmill.config import ModelConfig
        from tokenmill.worker.model_setup import load_model
        from tokenmill.models.arch import kv_cache_layout

        config = ModelConfig(model=source.path, attention_backend=attention_backend, quantization="none")
        self.model, self.backend = load_model(source, config, device, dtype, max_model_len)
        self.spec = kv_cache_layout(source.arch, dtype.itemsize).groups[0].spec
        self.dtype, self.device = dtype, device
        self.description = f"{source.arch.architecture} decoder, {dtype}, {type(self.backend).__name__} attention"

    def __call__(self, sequences: list[list[int]]) -> torch.Tensor:
        from tokenmill.attention.base import SequenceChunk

        chunks, slots, ids, positions = [], [], [], []
        next_block = 0
        for tokens in sequences:  # each sequence in blocks of its own, laid out one after another
            n = len(tokens)
            blocks = list(range(next_block, next_block + -(-n // _SCRATCH_BLOCK)))
            chunks.append(SequenceChunk(len(ids), n, n, blocks))
            slots.extend(range(next_block * _SCRATCH_BLOCK, next_block * _SCRATCH_BLOCK + n))
            next_block += len(blocks)
            ids.extend(tokens)
            positions.extend(range(n))
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)  # noqa: E731
        metadata = self.backend.build_metadata(chunks, as_tensor(slots), _SCRATCH_BLOCK, self.device)
        shape = self.backend.kv_cache_shape(next_block, _SCRATCH_BLOCK, self.spec.num_kv_heads, self.spec.head_dim,
                                            self.spec.planes)
        caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.model.layers]
        return self.model(as_tensor(ids), as_tensor(positions), caches, [metadata] * len(caches))
