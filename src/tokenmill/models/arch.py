"""The architecture description every model loader produces and every model consumes.

Loaders (HF folder, GGUF file) translate their own metadata into `ArchConfig`; models never read
`config.json` or GGUF keys themselves, so a new checkpoint format is one new loader.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tokenmill.core.kv_spec import KVCacheLayout, KVCacheSpec, StateCacheSpec, group_layers
from tokenmill.layers.rotary import RopeScaling
from tokenmill.models.vision.config import VisionConfig

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
# Llama 4's local layers: a query sees only the keys of its own chunk of `attention_chunk_size` positions
CHUNKED_ATTENTION = "chunked_attention"


@dataclass(frozen=True)
class MoEConfig:
    """A sparse MLP: `num_experts` SwiGLU experts of width `intermediate_size`, `top_k` of them per token.

    Router (`scoring` "softmax"): softmax over the experts' logits, the top k kept, renormalised to sum 1 when
    `norm_topk_prob` (Mixtral, Qwen3-MoE) or used as they are (OLMoE, DeepSeek-V2), times `routed_scaling_factor`.
    `scoring` "sigmoid" (DeepSeek-V3's noaux_tc, GLM-4.5): sigmoid scores, the top k chosen by score plus a
    per-expert correction bias within the best `topk_groups` of `num_groups` expert groups, weighted by their
    scores (layers/moe.py's `route_grouped_sigmoid`).
    `scoring` "topk_softmax" (GPT-OSS): the top k logits chosen, then a softmax over those k alone.
    `scoring` "sigmoid_input" (Llama 4): the top k logits chosen, each expert's weight sigmoid(logit) scales the
    expert's INPUT (the token's row), and the experts' outputs are added unweighted.
    `router_bias`: the router adds a per-expert bias to its logits (GPT-OSS). `swiglu_limit` (GPT-OSS's experts,
    layers/gpt_oss_experts.py): every projection of an expert has a bias, and the activation is the clamped
    SwiGLU (up + 1) * gate * sigmoid(`swiglu_alpha` * gate), gate clamped above at the limit and up to +-limit.
    `expert_activation` "relu2" (Nemotron-H): experts without a gate, down(relu(up(x))²) (models/nemotron_h.py).
    `shared_intermediate_size` > 0 adds an always-on SwiGLU expert of that width (DeepSeek's shared experts,
    fused into one); with `shared_expert_gate` (Qwen2-MoE) its output is scaled per token by
    sigmoid(x . w), w a [1, hidden] gate. `dense_layers` run a plain MLP of the model's `intermediate_size`
    instead.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0
    dense_layers: frozenset[int] = frozenset()
    shared_expert_gate: bool = False
    scoring: str = "softmax"  # softmax | sigmoid | topk_softmax | sigmoid_input
    num_groups: int = 1
    topk_groups: int = 1
    router_bias: bool = False
    swiglu_limit: Optional[float] = None  # GPT-OSS's biased experts with the clamped SwiGLU; None: plain SwiGLU
    swiglu_alpha: float = 1.702
    # "relu2" (Nemotron-H): each expert (and the shared one) is down(relu(up(x))²), no gate; "swiglu": gated
    expert_activation: str = "swiglu"


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2): keys and values come from one compressed latent of
    `kv_lora_rank` per token plus a shared RoPE key of `qk_rope_head_dim`, which is all the cache holds.
    `q_lora_rank` None: queries are projected directly from the hidden state."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: Optional[int] = None


@dataclass(frozen=True)
class MambaConfig:
    """Mamba2's mixer (models/mamba2.py), as transformers' Mamba2Config describes it: in_proj gives the gate
    z, the conv input xBC (x of `num_heads` x `head_dim`, B and C of `n_groups` x `state_size` each) and dt per
    head; a causal depthwise conv of `conv_kernel` taps (+ bias when `conv_bias`) and SiLU over xBC; the
    selective scan with dt = softplus(dt + dt_bias), A = -exp(A_log) and the D skip; a gated RMSNorm (one per
    group of the n_groups) and out_proj (both projections biased when `bias`). `chunk_size`: the prefill
    scan's chunk length. `gate_norm` (layers/mamba2_mixer.py): "after_gate" RMSNorm(y * silu(z)) (Mamba2,
    Granite 4.0-H, Nemotron-H), "before_gate" RMSNorm(y) * silu(z), "none" y * silu(z) without a norm (Falcon-H1's
    two settings). `dt_min` > 0: dt clamped from below at it (Nemotron-H's time_step_min), in every step."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    norm_eps: float
    conv_bias: bool = True
    bias: bool = False
    gate_norm: str = "after_gate"  # after_gate | before_gate | none
    dt_min: float = 0.0

    @property
    def intermediate_size(self) -> int:
        """Width of x (and of z): num_heads x head_dim."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: x, B and C."""
        return self.intermediate_size + 2 * self.n_groups * self.state_size


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """Qwen3-Next's Gated DeltaNet linear attention (layers/gated_deltanet.py), as transformers'
    Qwen3NextGatedDeltaNet computes it: q and k of `num_key_heads` x `key_head_dim`, v and the output gate z of
    `num_value_heads` x `value_head_dim` (each key head serves num_value_heads / num_key_heads value heads); a
    causal depthwise conv of `conv_kernel` taps (no bias) and SiLU over q, k and v; q and k L2-normed; decay
    g = -exp(A_log) * softplus(a + dt_bias) and write strength beta = sigmoid(b) per value head; a per-head
    gated RMSNorm (eps `norm_eps`) of the output times silu(z). Its recurrent state per request: the conv window
    and a [num_value_heads, key_head_dim, value_head_dim] float32 matrix per value head."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    norm_eps: float

    @property
    def key_dim(self) -> int:
        """Width of q (and of k)."""
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        """Width of v (and of z and the output)."""
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class FalconH1Multipliers:
    """Falcon-H1's muP multipliers (models/falcon_h1.py folds them into the projections' weights at load): the
    attention's input (`attention_in`), keys (`key`) and output (`attention_out`); the Mamba2 mixer's input
    (`ssm_in`), its in_proj's five parts z, x, B, C, dt (`ssm_projections`) and its output (`ssm_out`); the MLP's
    gate (`mlp_gate`) and down projection (`mlp_down`)."""

    attention_in: float
    key: float
    attention_out: float
    ssm_in: float
    ssm_projections: tuple[float, float, float, float, float]
    ssm_out: float
    mlp_gate: float
    mlp_down: float


@dataclass(frozen=True)
class LayerSpec:
    """What differs from one decoder layer to the next: its attention kind, window and RoPE base, whether
    its MLP is sparse and whether it rotates q and k at all."""

    attention: str  # FULL_ATTENTION | SLIDING_ATTENTION | CHUNKED_ATTENTION
    sliding_window: Optional[int]  # tokens a query sees, itself included (None: all)
    rope_theta: float
    moe: bool
    rope: bool = True  # False: a NoPE layer (SmolLM3), q and k attend unrotated
    mixer: str = "attention"  # "mamba": a Mamba2 mixer and no MLP (models/mamba2.py)
    # ("gated_deltanet": Qwen3-Next's linear attention, models/qwen3_next.py)
    # Llama 4's chunked local attention: a query at position p sees keys [(p // chunk) * chunk, p] (None: no chunks)
    attention_chunk: Optional[int] = None


@dataclass(frozen=True)
class ArchConfig:
    """Hyper-parameters of a decoder-only transformer: the Llama family, Gemma 3, MoE and MLA models.

    `architecture` is the HF class name (e.g. "LlamaForCausalLM"); the registry maps it to a model.
    What differs per layer comes from `layer_spec(i)`; the model-wide variations are the fields below.
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
    attention_out_bias: bool = False  # bias on the output projection too (Llama/Qwen3/Gemma 3 attention_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    qk_norm_per_head: bool = True  # False (OLMoE): the q/k norm spans the whole q and k projections
    rope_scaling: Optional[RopeScaling] = None
    sliding_window: Optional[int] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    checkpoint_dtype: str = "float32"  # the dtype the weights are stored in ("auto" resolves from it)
    # per-layer attention kinds (FULL_ATTENTION / SLIDING_ATTENTION); empty: every layer is
    # sliding when `sliding_window` is set, else full
    layer_types: tuple[str, ...] = ()
    rope_local_theta: Optional[float] = None  # RoPE base of sliding layers (Gemma 3), else rope_theta
    hidden_act: str = "silu"  # the MLP's gate activation: silu | gelu_tanh
    norm_weight_offset: float = 0.0  # RMSNorm scales by (offset + weight): Gemma stores weight - 1
    sandwich_norms: bool = False  # Gemma 3: norms after attention and MLP as well as before
    post_norms: bool = False  # OLMo 2/3: norms after attention and MLP only, none before (x + norm(block(x)))
    embedding_scale: Optional[float] = None  # embeddings multiplied by this (Gemma: sqrt(hidden))
    attention_scale: Optional[float] = None  # softmax scale (default head_dim ** -0.5)
    final_logit_softcap: Optional[float] = None  # logits -> cap * tanh(logits / cap)
    attn_logit_softcap: Optional[float] = None  # Gemma 2: attention scores -> cap * tanh(scores / cap)
    # GPT-OSS: each query head has a learned logit (`sinks`) that joins its softmax's denominator and takes no value
    attention_sinks: bool = False
    no_rope_layers: frozenset[int] = frozenset()  # SmolLM3: the layers without rotary embeddings (NoPE)
    moe: Optional[MoEConfig] = None
    mla: Optional[MLAConfig] = None
    vision: Optional[VisionConfig] = None  # a vision-language model's image side (models/vision/)
    # multimodal RoPE (Qwen2-VL): the rotary frequencies, in order, split into temporal, height and width
    # sections of these sizes, each turned by that component of a token's 3-D position
    mrope_section: Optional[tuple[int, ...]] = None
    # partial RoPE (GLM-4.5's partial_rotary_factor): only the first rotary_dim dims of each q/k head turn, the
    # rest pass through; None: the whole head
    rotary_dim: Optional[int] = None
    # Mamba2 (models/mamba2.py): every layer a Mamba2 mixer keeping a recurrent state per request
    mamba: Optional[MambaConfig] = None
    # a hybrid (Granite 4.0-H, models/granite_hybrid.py): the layers whose mixer is a Mamba2 mixer (`mamba`), the
    # others attention, every layer with its MLP; None (with `mamba`): every layer a Mamba2 mixer and no MLP
    mamba_layers: Optional[frozenset[int]] = None
    # Nemotron-H (models/nemotron_h.py): each layer's blocks in hybrid_override_pattern's letters, its mixer first
    # (M: Mamba2, *: attention) then the MLP blocks that follow it (-); empty: not Nemotron-H
    layer_blocks: tuple[str, ...] = ()
    # Falcon-H1 (models/falcon_h1.py): its layer i runs as layers 2i (the Mamba2 mixer) and 2i + 1 (attention, in
    # parallel on the same input, then the MLP); its multipliers; None: not Falcon-H1
    falcon_h1: Optional[FalconH1Multipliers] = None
    # Granite: each block's output joins the residual stream times this (stream + m * block(norm(stream)))
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0  # Granite: the logits divided by this
    # Qwen3-Next (models/qwen3_next.py): the layers whose mixer is a Gated DeltaNet (`gated_deltanet`), keeping a
    # recurrent state per request; the others attention
    gated_deltanet: Optional[GatedDeltaNetConfig] = None
    gated_deltanet_layers: frozenset[int] = frozenset()
    # Qwen3-Next's gated attention: q_proj also gives a gate per head, the attention output times sigmoid(gate)
    attention_output_gate: bool = False
    # Llama 4: the chunk of its chunked_attention layers (layer_types), in positions
    attention_chunk_size: Optional[int] = None
    # Llama 4's use_qk_norm: each head of q and k scaled to unit RMS (no weight, eps rms_norm_eps) AFTER RoPE, on
    # the RoPE layers only
    qk_l2_norm: bool = False
    # Llama 4's attention temperature tuning (floor_scale, attn_scale): on NoPE layers q at position p is scaled by
    # 1 + attn_scale * log(1 + floor((p + 1) / floor_scale)); None: never
    nope_query_temperature: Optional[tuple[float, float]] = None

    def __post_init__(self) -> None:
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers but num_hidden_layers is "
                             f"{self.num_hidden_layers}")
        unknown = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION, CHUNKED_ATTENTION}
        if unknown:
            raise ValueError(f"unsupported layer types {sorted(unknown)}; supported: {FULL_ATTENTION}, "
                             f"{SLIDING_ATTENTION}, {CHUNKED_ATTENTION}")
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a sliding_window")
        if CHUNKED_ATTENTION in self.layer_types and not (self.attention_chunk_size or 0) > 0:
            raise ValueError("chunked_attention layers need a positive attention_chunk_size")
        if self.post_norms and self.sandwich_norms:
            raise ValueError("post_norms and sandwich_norms are two placements of the same norms: choose one")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: silu, gelu_tanh")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.mrope_section is not None and (len(self.mrope_section) != 3
                                               or 2 * sum(self.mrope_section) != self.head_dim):
            raise ValueError(f"mrope_section {list(self.mrope_section)} must be 3 sections of the head's "
                             f"{self.head_dim // 2} rotary frequencies")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim ({self.rotary_dim}) must be even and at most head_dim ({self.head_dim}): "
                             "RoPE rotates pairs of a head's dims")
        if self.mla is not None and self.mla.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim ({self.mla.qk_rope_head_dim}) must be even: RoPE rotates pairs")

    def layer_spec(self, index: int) -> LayerSpec:
        """Layer `index`'s attention kind, window, RoPE base and MLP kind."""
        if self.layer_types:
            kind = self.layer_types[index]
        else:
            kind = SLIDING_ATTENTION if self.sliding_window else FULL_ATTENTION
        sliding = kind == SLIDING_ATTENTION
        theta = self.rope_local_theta if sliding and self.rope_local_theta is not None else self.rope_theta
        moe = self.moe is not None and index not in self.moe.dense_layers
        mamba = self.mamba is not None and (self.mamba_layers is None or index in self.mamba_layers)
        chunk = self.attention_chunk_size if kind == CHUNKED_ATTENTION else None
        mixer = "mamba" if mamba else "gated_deltanet" if index in self.gated_deltanet_layers else "attention"
        return LayerSpec(kind, self.sliding_window if sliding else None, theta, moe, index not in self.no_rope_layers,
                         mixer=mixer, attention_chunk=chunk)

    @property
    def keeps_recurrent_state(self) -> bool:
        """Whether any layer keeps a recurrent state per request (Mamba2 mixers, Gated DeltaNet)."""
        return self.mamba is not None or self.gated_deltanet is not None

    @property
    def has_sliding_layers(self) -> bool:
        """Whether any layer attends through a sliding window."""
        return any(self.layer_spec(i).attention == SLIDING_ATTENTION for i in range(self.num_hidden_layers))

    @property
    def has_chunked_layers(self) -> bool:
        """Whether any layer attends within chunks (Llama 4's chunked_attention)."""
        return CHUNKED_ATTENTION in self.layer_types


def kv_cache_geometry(arch: ArchConfig, tp_size: int = 1) -> tuple[int, int]:
    """(KV heads, head dim) of one rank's per-layer KV cache: the model's KV heads split over `tp_size`
    ranks; for MLA one head of the latent plus the RoPE key (kv_lora_rank + qk_rope_head_dim), which
    tensor parallelism does not split (ValueError above 1)."""
    if arch.mla is not None:
        if tp_size > 1:
            raise ValueError(f"MLA models run at tensor_parallel_size 1 (asked for {tp_size}): "
                             "attention heads are not sharded")
        return 1, arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim
    return arch.num_key_value_heads // tp_size, arch.head_dim


def kv_cache_spec(arch: ArchConfig, dtype_bytes: int, tp_size: int = 1,
                  sliding_window: Optional[int] = None, quantized: Optional[str] = None,
                  attention_chunk: Optional[int] = None) -> KVCacheSpec:
    """What one rank's layer caches per token, for a layer of the given window or attention chunk (None: full
    attention); `quantized`: one-byte rows, "int8" or "fp8" (--kv-cache-dtype)."""
    kv_heads, head_dim = kv_cache_geometry(arch, tp_size)
    mla = None if arch.mla is None else (arch.mla.kv_lora_rank, arch.mla.qk_rope_head_dim)
    return KVCacheSpec(kv_heads, head_dim, dtype_bytes, sliding_window, mla, quantized, attention_chunk)


def kv_cache_layout(arch: ArchConfig, dtype_bytes: int, tp_size: int = 1, quantized: Optional[str] = None
                    ) -> KVCacheLayout:
    """One rank's KV cache groups: layers grouped by what they cache per token (full attention, a sliding
    window, chunked local attention, an MLA latent) or per request (a Mamba2 layer's recurrent state), see
    core/kv_spec.py."""
    if arch.mamba is not None:
        if quantized:
            raise ValueError(f"kv_cache_dtype {quantized}: {arch.architecture}'s recurrent states are not quantised; "
                             "use auto")
        m = arch.mamba
        state = StateCacheSpec(m.conv_kernel, m.conv_dim, m.num_heads, m.head_dim, m.state_size, dtype_bytes)
        # a hybrid's attention layers beside them (core/kv_spec.py: the state lives in attention-sized blocks)
        return group_layers([state if spec.mixer == "mamba" else
                             kv_cache_spec(arch, dtype_bytes, tp_size, spec.sliding_window, None, spec.attention_chunk)
                             for spec in (arch.layer_spec(i) for i in range(arch.num_hidden_layers))])
    if arch.gated_deltanet is not None:
        return _gated_deltanet_layout(arch, dtype_bytes, tp_size, quantized)
    specs = (arch.layer_spec(i) for i in range(arch.num_hidden_layers))
    return group_layers([kv_cache_spec(arch, dtype_bytes, tp_size, spec.sliding_window, quantized, spec.attention_chunk)
                         for spec in specs])


def _gated_deltanet_layout(arch: ArchConfig, dtype_bytes: int, tp_size: int, quantized: Optional[str]
                           ) -> KVCacheLayout:
    """Qwen3-Next's groups: its Gated DeltaNet layers' states (the conv window of q, k and v, and one
    key_head_dim x value_head_dim matrix per value head, StateCacheSpec's SSM state) beside its attention layers'
    K/V, in attention-sized blocks as a Mamba2 hybrid's (core/kv_spec.py)."""
    if quantized:
        raise ValueError(f"kv_cache_dtype {quantized}: {arch.architecture}'s recurrent states are not quantised; "
                         "use auto")
    d = arch.gated_deltanet
    state = StateCacheSpec(d.conv_kernel, d.conv_dim, d.num_value_heads, d.key_head_dim, d.value_head_dim,
                           dtype_bytes)
    return group_layers([state if spec.mixer == "gated_deltanet" else
                         kv_cache_spec(arch, dtype_bytes, tp_size, spec.sliding_window, None, spec.attention_chunk)
                         for spec in (arch.layer_spec(i) for i in range(arch.num_hidden_layers))])
