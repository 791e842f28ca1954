"""The architecture description every model loader produces and every model consumes.

Loaders (HF folder, GGUF file) translate their own metadata into `ArchConfig`; models never read
`config.json` or GGUF keys themselves, so a new checkpoint format is one new loader.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling.

    `kind` is "llama3" (Llama 3.1 smooth wavelength scaling, with the factors below), "linear"
    (positions divided by `factor`) or "factors" (explicit per-frequency divisors, as GGUF stores
    them in `rope_freqs.weight`; the divisors are loaded as a tensor, not kept here).
    """

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ArchConfig:
    """Hyper-parameters of a decoder-only transformer in the Llama family.

    `architecture` is the HF class name (e.g. "LlamaForCausalLM"); the registry maps it to a model.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q, k and v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    rope_scaling: Optional[RopeScaling] = None
    sliding_window: Optional[int] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    checkpoint_dtype: str = "float32"  # the dtype the weights are stored in ("auto" resolves from it)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
