"""BERT-family encoders (BertModel, RobertaModel, XLMRobertaModel) over a flattened batch of sequences.

Bidirectional attention, so no KV cache: every sequence is encoded whole in one step. Parameter
names are Hugging Face's, so a checkpoint loads by name. The projections are the engine's linear
layers (layers/linear.py) and each sequence attends on its own, so a sequence's states do not depend
on what else shares the step.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.linear import ColumnParallelLinear
from tokenmill.models.named_weights import load_named_weights

_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
_ROBERTA_TYPES = ("roberta", "xlm-roberta")
_IGNORED_PREFIXES = ("pooler.", "embeddings.position_ids", "lm_head.", "cls.", "classifier.")


def _frozen(module: nn.Module) -> nn.Module:
    for param in module.parameters():
        param.requires_grad_(False)
    return module


def _linear(in_features: int, out_features: int) -> ColumnParallelLinear:
    return ColumnParallelLinear(in_features, out_features, bias=True)


class _Embeddings(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.word_embeddings = _frozen(nn.Embedding(config["vocab_size"], hidden))
        self.position_embeddings = _frozen(nn.Embedding(config["max_position_embeddings"], hidden))
        self.token_type_embeddings = _frozen(nn.Embedding(config.get("type_vocab_size", 2), hidden))
        self.LayerNorm = _frozen(nn.LayerNorm(hidden, eps=config.get("layer_norm_eps", 1e-12)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_types)
        return self.LayerNorm(x + self.position_embeddings(positions))


class _SelfAttention(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.query, self.key, self.value = _linear(hidden, hidden), _linear(hidden, hidden), _linear(hidden, hidden)


class _Output(nn.Module):
    def __init__(self, in_features: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = _linear(in_features, hidden)
        self.LayerNorm = _frozen(nn.LayerNorm(hidden, eps=eps))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.self = _SelfAttention(hidden)
        self.output = _Output(hidden, hidden, eps)


class _Intermediate(nn.Module):
    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.dense = _linear(hidden, width)


class _Layer(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("layer_norm_eps", 1e-12)
        self.num_heads = config["num_attention_heads"]
        self.attention = _Attention(hidden, eps)
        self.intermediate = _Intermediate(hidden, config["intermediate_size"])
        self.output = _Output(config["intermediate_size"], hidden, eps)
        act = config.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        attn = self.attention.self
        heads = self.num_heads
        q, k, v = (proj(x).view(x.shape[0], heads, -1).transpose(0, 1) for proj in (attn.query, attn.key, attn.value))
        context = torch.empty_like(q)
        start = 0
        for length in seq_lens:  # each sequence sees only itself: its result does not depend on the others
            span = slice(start, start + length)
            context[:, span] = F.scaled_dot_product_attention(q[:, span], k[:, span], v[:, span])
            start += length
        attended = self.attention.output(context.transpose(0, 1).reshape(x.shape), x)
        return self.output(self.act(self.intermediate.dense(attended)), attended)


class _Encoder(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(config) for _ in range(config["num_hidden_layers"]))


class BertEncoder(nn.Module):
    """Token states [T, hidden] of sequences laid end to end; `hf_config` is the model's config.json."""

    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        self.config = hf_config
        if hf_config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {hf_config['position_embedding_type']!r} is not supported "
                             "(supported: absolute)")
        # RoBERTa counts positions from after its padding id
        roberta = hf_config.get("model_type") in _ROBERTA_TYPES
        self.position_offset = hf_config.get("pad_token_id", 1) + 1 if roberta else 0
        self.max_positions = hf_config["max_position_embeddings"] - self.position_offset
        self.vocab_size = hf_config["vocab_size"]
        self.embeddings = _Embeddings(hf_config)
        self.encoder = _Encoder(hf_config)

    def forward(self, input_ids: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """input_ids [T] (the sequences in order, lengths `seq_lens`) -> final states [T, hidden]."""
        positions = torch.cat([torch.arange(n, device=input_ids.device) for n in seq_lens]) + self.position_offset
        x = self.embeddings(input_ids, positions, torch.zeros_like(input_ids))
        for layer in self.encoder.layer:
            x = layer(x, seq_lens)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (a `bert.`/`roberta.` prefix is dropped; pooler and heads are ignored);
        ValueError if a parameter is left unset, a name is unknown or a shape differs."""
        def own_name(name: str) -> str:
            for prefix in ("bert.", "roberta.", "model."):
                name = name.removeprefix(prefix)
            return name

        load_named_weights(self, ((own_name(name), tensor) for name, tensor in weights), type(self).__name__, "",
                           lambda name: name.startswith(_IGNORED_PREFIXES))

    def use_linear_kernels(self, packed: bool, native: Any = None, batch_invariant: bool = True) -> None:
        """After loading: route every projection through the engine's linear kernels (layers/linear_kernels.py)."""
        for module in self.modules():
            if hasattr(module, "use_kernel"):
                module.use_kernel(packed, native, batch_invariant)
