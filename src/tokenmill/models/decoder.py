"""The decoder-only LM every supported architecture runs as: Llama 2/3, Mistral, SmolLM2, Qwen2 (QKV
bias), Qwen3 (q/k norm), Gemma 3 (sliding-window layers, local/global RoPE, sandwich norms, GeGLU,
scaled embeddings, logit soft-capping), Gemma 2 (attention-score soft-capping), SmolLM3 (NoPE layers),
OLMo 2/3 (norms after the blocks only), Phi-3 / Phi-4-mini (LongRoPE, partial rotary), the mixtures of
experts Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (layers/moe.py; OLMoE's q/k norm spans the whole
projection), DeepSeek-V2/V3 (multi-head latent attention, models/mla_attention.py), GLM-4.5 (partial RoPE),
GPT-OSS (attention sinks, biased experts with a clamped SwiGLU, layers/gpt_oss_experts.py), Llama 4's text
model (chunked local attention, NoPE layers with a query temperature, a q/k L2 norm, experts whose routing weight
scales their input, loader/llama4_tensors.py), Mamba2 (models/mamba2.py) and the hybrids Granite 4.0-H (Mamba2 and
attention layers, models/granite_hybrid.py), Nemotron-H (Mamba2, NoPE attention and relu² MLP blocks,
models/nemotron_h.py), Falcon-H1 (a Mamba2 mixer beside attention in every layer, models/falcon_h1.py) and
Qwen3-Next (Gated DeltaNet and gated attention layers, models/qwen3_next.py).

GQA, RMSNorm, RoPE (optionally scaled), gated MLPs, tied or untied embeddings: one implementation whose
differences come from `ArchConfig` (model-wide fields and `layer_spec(i)` per layer), running on a
flattened token batch with a paged KV cache.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import nn

from tokenmill.attention.base import AttentionBackend
from tokenmill.layers.activation import GeluTanhAndMul, SiluAndMul
from tokenmill.layers.gpt_oss_experts import BiasedExpertMLP, gpt_oss_expert_tensors
from tokenmill.layers.linear import MergedColumnParallelLinear, RowParallelLinear, default_weight_loader
from tokenmill.layers.linear_kernels import DenseKernel, LinearKernel, QuantizedKernel, make_kernel
from tokenmill.layers.moe import MoEBlock, expert_checkpoint_names, local_experts
from tokenmill.kernels.quantized import FORMATS as QUANTIZED_FORMATS, QuantizedWeight, quantize
from tokenmill.kernels.w8a8 import INT8, W8A8Weight
from tokenmill.layers.norm import RMSNorm
from tokenmill.models.arch import ArchConfig, LayerSpec
from tokenmill.models.attention_block import RopeInputs, RotaryTables, SelfAttention
from tokenmill.models.kernel_choice import KernelChoice
from tokenmill.models.falcon_h1 import falcon_h1_checkpoint_tensors, falcon_h1_layer
from tokenmill.models.granite_hybrid import GraniteHybridLayer, granite_hybrid_checkpoint_names
from tokenmill.models.nemotron_h import NemotronHLayer, nemotron_h_checkpoint_names
from tokenmill.models.mamba2 import Mamba2Layer, mamba2_checkpoint_names
from tokenmill.models.qwen3_next import GatedDeltaNetLayer, qwen3_next_checkpoint_tensors
from tokenmill.models.loader.fused_tensors import split_fused_projections
from tokenmill.models.loader.llama4_tensors import llama4_checkpoint_tensors
from tokenmill.models.mla_attention import MLAAttention
from tokenmill.parallel.group import PipelineStage, TPGroup


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused; act is SiLU (SwiGLU) or tanh-GELU (GeGLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp=tp)
        self.act = SiluAndMul() if hidden_act == "silu" else GeluTanhAndMul()

    def intermediate(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate(x)) * up(x), what the down projection takes (MoEBlock runs an expert in these two steps)."""
        return self.act(self.gate_up_proj(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        return self.down_proj(self.intermediate(x))


def make_mlp(arch: ArchConfig, spec: LayerSpec, tp: TPGroup) -> nn.Module:
    """The layer's MLP: dense, or a mixture of experts (each expert a GatedMLP, or GPT-OSS's BiasedExpertMLP) where
    the layer's spec says so."""
    if spec.moe:  # experts whole on the ranks that hold them (expert parallelism), else split like this MLP
        experts_tp = TPGroup.single() if tp.expert_parallel else tp
        moe = arch.moe
        if moe.swiglu_limit is not None:
            expert = lambda width: BiasedExpertMLP(arch.hidden_size, width, moe.swiglu_limit,  # noqa: E731
                                                   moe.swiglu_alpha, experts_tp)
        else:
            expert = lambda width: GatedMLP(arch.hidden_size, width, arch.hidden_act, experts_tp)  # noqa: E731
        return MoEBlock(moe, arch.hidden_size, expert, tp)
    return GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act, tp)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residual connections; with `sandwich_norms` (Gemma 3)
    each block's output is normed too before it joins the residual stream; with `post_norms` (OLMo 2/3)
    only the output is: each block reads the residual stream itself."""

    def __init__(self, arch: ArchConfig, index: int, backend: AttentionBackend, tp: TPGroup) -> None:
        super().__init__()
        spec = arch.layer_spec(index)
        norm = lambda: RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_weight_offset)  # noqa: E731
        self.post_norms = arch.post_norms
        if not self.post_norms:  # (an OLMo 2 checkpoint has no input norm)
            self.input_layernorm = norm()
        # DeepSeek-V2: multi-head latent attention (its cache holds the latent, models/mla_attention.py)
        self.self_attn = (MLAAttention if arch.mla is not None else SelfAttention)(arch, spec, backend, tp)
        self.post_attention_layernorm = norm()  # Llama: before the MLP; Gemma, OLMo 2: after attention
        self.sandwich = arch.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
        if self.sandwich or self.post_norms:
            self.post_feedforward_layernorm = norm()
        self.mlp = make_mlp(arch, spec, tp)

    def forward(self, rope: RopeInputs, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                kv_cache: torch.Tensor, attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """One transformer block on the (block output, residual stream) pair; the first layer gets
        residual=None and the embeddings as `hidden`. The stream's value after the block is
        residual + hidden, which the next norm adds up (fused with it where a kernel does both)."""
        if self.post_norms:
            return self._post_norm_forward(rope, hidden, residual, kv_cache, attn_metadata)
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, normed, kv_cache, attn_metadata)
        if self.sandwich:
            hidden = self.post_attention_layernorm(hidden)
            normed, residual = self.pre_feedforward_layernorm(hidden, residual)
            return self.post_feedforward_layernorm(self.mlp(normed)), residual
        normed, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(normed), residual

    def _post_norm_forward(self, rope: RopeInputs, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                           kv_cache: torch.Tensor, attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """OLMo 2's block: stream += norm(attention(stream)); then (norm(mlp(stream)), stream), the MLP's normed
        output joining the stream at the next norm as every layer's output does."""
        stream = hidden if residual is None else residual + hidden
        stream = stream + self.post_attention_layernorm(self.self_attn(rope, stream, kv_cache, attn_metadata))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


# checkpoint projections that the model stacks into one parameter: (checkpoint name, parameter, shard)
STACKED = (("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v"),
           ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1))


def stacked_target(name: str, fuse_q: bool = True) -> tuple[str, Any]:
    """(parameter name, shard) a checkpoint tensor loads into: a q/k/v or gate/up projection into its shard of the
    stacked parameter (STACKED), any other tensor into the parameter of its own name (shard None). `fuse_q` False:
    q_proj is a parameter of its own."""
    for ckpt, fused, shard in STACKED:
        if (fuse_q or ckpt != "q_proj") and f".{ckpt}." in name:
            return name.replace(ckpt, fused), shard
    return name, None


class DecoderForCausalLM(nn.Module):
    """Decoder-only LM over a flattened token batch; `compute_logits` runs the head on chosen rows only.

    Under tensor parallelism (`tp`) each rank holds its heads, its share of the MLP and its rows of the
    vocabulary (embedding and head): embeddings and row-parallel outputs are summed over the ranks, and
    the logits are gathered on the driver rank (the others get None); with `tp.expert_parallel` a MoE
    layer holds its share of the experts, whole, else its slice of every expert (layers/moe.py). Under pipeline parallelism
    (`stage`) a rank holds only its stage's layers: it receives the previous stage's (hidden, residual)
    and passes its own on; only the last stage returns hidden states. Every stage keeps the embedding
    and head (small next to the layers for the models run here).
    """

    def __init__(self, arch: ArchConfig, backend: AttentionBackend, max_positions: int,
                 tp: TPGroup = TPGroup.single(), stage: PipelineStage = PipelineStage()) -> None:
        super().__init__()
        self.arch, self.tp, self.stage = arch, tp, stage
        self.first_layer = stage.first_layer
        end_layer = arch.num_hidden_layers if stage.end_layer < 0 else stage.end_layer
        self.local_vocab = tp.shard(arch.vocab_size, "vocabulary")
        self.vocab_start = tp.rank * self.local_vocab
        # MLA: k_pe, q_pe only; partial rotary: the first rotary_dim dims of each head
        rotated = arch.mla.qk_rope_head_dim if arch.mla is not None else arch.rotary_dim or arch.head_dim
        # (Mamba2 has no attention, nothing to rotate; a hybrid's attention layers do)
        attends = arch.mamba is None or arch.mamba_layers is not None
        self.rotary = RotaryTables(arch, rotated, max_positions) if attends else None
        # uninitialised: the checkpoint's weights replace it (nn.Embedding's own random init of SmolLM2's table
        # costs 0.4 s a load, Gemma 3's 262k rows 2 s)
        self.embed_tokens = nn.Embedding(self.local_vocab, arch.hidden_size,
                                         _weight=torch.empty(self.local_vocab, arch.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        # a Mamba2 layer (models/mamba2.py) where the layer's spec says so; a hybrid's layers (Granite 4.0-H,
        # models/granite_hybrid.py) a Mamba2 mixer or attention, each with its MLP; Nemotron-H's and Falcon-H1's
        # their own (models/nemotron_h.py, models/falcon_h1.py)
        def layer(index: int) -> nn.Module:
            if arch.layer_blocks:
                return NemotronHLayer(arch, index, backend, tp)
            if arch.falcon_h1 is not None:
                return falcon_h1_layer(arch, index, backend, tp, make_mlp)
            if arch.mamba_layers is not None:
                return GraniteHybridLayer(arch, index, backend, tp, make_mlp)
            if arch.layer_spec(index).mixer == "gated_deltanet":  # Qwen3-Next's linear attention layers
                return GatedDeltaNetLayer(arch, index, tp, make_mlp)
            return (Mamba2Layer if arch.layer_spec(index).mixer == "mamba" else DecoderLayer)(arch, index, backend, tp)

        self.layers = nn.ModuleList(layer(index) for index in range(self.first_layer, end_layer))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_weight_offset)
        self.lm_head = None
        if not arch.tie_word_embeddings:
            # uninitialised too, for the same reason (nn.Linear's kaiming init of a 201088-row head: 0.5 s at hidden
            # 64); load_weights raises for a parameter the checkpoint leaves unset. The weight is made where the
            # model is built (the loader's device and dtype context), the module shell on meta.
            self.lm_head = nn.Linear(arch.hidden_size, self.local_vocab, bias=False, device="meta")
            self.lm_head.weight = nn.Parameter(torch.empty(self.local_vocab, arch.hidden_size), requires_grad=False)
        self.logits_kernel: Optional[LinearKernel] = None
        self.kernel_choice: Optional[KernelChoice] = None  # see apply_kernels
        self.kernels: Any = None  # the element-wise ops' kernels (kernel_choice.elementwise)
        # the embedding table and untied head when kept quantised (see load_weights); a tied table that
        # the native kernels multiply becomes their op (QLinearOp), which also does the lookups, so the
        # table is held once (both have `format` and `embedding(ids, dtype)`)
        self.embed_quantized: Any = None
        self.head_quantized: Optional[QuantizedWeight] = None
        self.fused_decode: Any = None  # the one-call step, when asked for and the model qualifies
        self.lora: Any = None  # ModelLoRA (lora/layers.py) when the engine serves LoRA adapters
        self.vision: Any = None  # a vision-language model's image side (models/vision/), set by build_model
        # EAGLE-3's taps (spec_decode/hidden_drafts.py): the residual stream entering each of these layers, kept
        # after every forward as `aux_hidden` [T, len(layers) x hidden] (empty: nothing kept)
        self.aux_hidden_layers: tuple[int, ...] = ()
        self.aux_hidden: Optional[torch.Tensor] = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[Any], image_embeds: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                ) -> Optional[torch.Tensor]:
        """input_ids, positions: [T] (or [3, T]: M-RoPE's temporal, height and width positions, in a step that
        computes image positions) -> final hidden states [T, hidden] (None on a stage before the last).
        `kv_caches` and `attn_metadata` have one entry per layer of this stage (its KV cache group's).
        `image_embeds` (rows [N], embeddings [N, hidden]): the input embeddings of those rows, in place of
        their (placeholder) tokens' — a vision-language model's images."""
        residual = None
        if self.stage.is_first:
            hidden = self.embed(input_ids)
            if image_embeds is not None:
                rows, embeds = image_embeds
                hidden = hidden.index_copy(0, rows, embeds.to(hidden.dtype))
            # the fused step runs only models of one KV cache group (_llama_shaped): one metadata for all
            # the native step has no LoRA deltas: a step with adapted rows runs the module path
            if self.fused_decode is not None and not (self.lora is not None and self.lora.active) \
                    and positions.dim() == 1 and self.fused_decode.applies(attn_metadata[0], hidden.shape[0]):
                fused = self.fused_decode(hidden, positions, kv_caches, attn_metadata[0], self.aux_hidden_layers)
                if fused is not None:
                    hidden, taps = fused
                    if taps is not None:
                        self.aux_hidden = taps
                    return hidden
        else:
            hidden, residual = self.stage.recv(input_ids.shape[0], self.arch.hidden_size, self.norm.weight.dtype,
                                               input_ids.device)
        rotary = self.rotary
        if positions.dim() == 2:  # M-RoPE positions [3, T]: this step's own tables, row t for token t
            rotary = self.rotary.for_step(positions, self.arch.mrope_section)
            positions = torch.arange(positions.shape[1], device=positions.device)
        rope = RopeInputs(rotary, positions, hidden.dtype, self.kernels) if rotary is not None else None
        taps = [] if self.aux_hidden_layers else None
        for index, (layer, kv_cache, metadata) in enumerate(zip(self.layers, kv_caches, attn_metadata),
                                                            self.first_layer):
            if taps is not None and index in self.aux_hidden_layers:
                taps.append(hidden if residual is None else hidden + residual)
            hidden, residual = layer(rope, hidden, residual, kv_cache, metadata)
        if taps is not None:
            self.aux_hidden = torch.cat(taps, dim=-1)
        if not self.stage.is_last:
            self.stage.send(hidden, residual)
            return None
        return self.norm(hidden, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings [T, hidden]; under tensor parallelism each rank looks up the ids in its rows of the
        vocabulary (zeros for the others) and the ranks' rows are summed (exactly: one is non-zero)."""
        outside = None
        if self.tp.size > 1:
            local = input_ids - self.vocab_start
            outside = (local < 0) | (local >= self.local_vocab)
            input_ids = local.masked_fill(outside, 0)
        if self.embed_quantized is not None:
            hidden = self.embed_quantized.embedding(input_ids, self.norm.weight.dtype)
        else:
            hidden = self.embed_tokens(input_ids)
        if outside is not None:
            hidden = self.tp.all_reduce(hidden.masked_fill(outside.unsqueeze(-1), 0))
        if self.arch.embedding_scale is not None:  # in the compute dtype, as HF multiplies it
            hidden = hidden * torch.tensor(self.arch.embedding_scale, dtype=hidden.dtype)
        return hidden

    def apply_kernels(self, choice: KernelChoice) -> None:
        """After loading, once: route the products, the element-wise ops and qualifying steps through the
        kernels `choice` names (in that order: the one-call step reads what the first two set up)."""
        assert self.kernel_choice is None, "a model's kernels are chosen once"
        self._use_linear_kernels(choice.packed, choice.native, choice.batch_invariant)
        if choice.elementwise is not None:
            self._use_elementwise_kernels(choice.elementwise)
        if choice.fused_decode:
            from tokenmill.models.fused_decode import FusedDecode

            self.fused_decode = FusedDecode.build(self, choice.kv_rows)
        self.kernel_choice = choice

    def _use_elementwise_kernels(self, kernels: Any) -> None:
        """Route RMSNorm (+ residual add), SiLU- and GELU-and-mul and RoPE through `kernels`."""
        self.kernels = kernels
        for module in self.modules():
            if isinstance(module, (RMSNorm, SiluAndMul, GeluTanhAndMul)):
                module.kernels = kernels

    def has_quantized_weights(self) -> bool:
        """Whether any projection, the embedding or the LM head is kept quantised."""
        return (self.embed_quantized is not None or self.head_quantized is not None
                or isinstance(self.logits_kernel, QuantizedKernel)
                or any(getattr(m, "quantized_format", None) is not None for m in self.modules()))

    def describe_weights(self) -> str:
        """How the weights are held, for the log: e.g. 'int4 projections, int8 embedding'."""
        projections = sorted({m.quantized_format or "float" for m in self.modules() if hasattr(m, "quantize_to")})
        parts = [f"{'+'.join(projections)} projections"]
        if self.embed_quantized is not None:
            parts.append(f"{self.embed_quantized.format} embedding")
        head = self.logits_kernel.format if isinstance(self.logits_kernel, QuantizedKernel) else None
        if self.lm_head is not None and (head or self.head_quantized):
            parts.append(f"{head or self.head_quantized.format} LM head")
        experts = next((d for m in self.modules() if isinstance(m, MoEBlock) and (d := m.describe())), None)
        if experts is not None:
            parts.append(f"{experts} on this rank")
        if self.fused_decode is not None:
            parts.append("fused decode")
        return ", ".join(parts)

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """[N, hidden] -> float32 logits [N, vocab] (on the driver rank; None on the others)."""
        if self.logits_kernel is not None:
            logits = self.logits_kernel(hidden).float()
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = torch.nn.functional.linear(hidden, weight).float()
        logits = self.tp.gather_last_dim(logits)
        if self.arch.logits_scaling != 1.0 and logits is not None:  # Granite: HF divides the logits
            logits = logits / self.arch.logits_scaling
        cap = self.arch.final_logit_softcap
        if cap is not None and logits is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _use_linear_kernels(self, packed: bool, native: Any = None, batch_invariant: bool = True) -> None:
        """After loading: route every projection and the LM head through `make_kernel`, or through
        `QuantizedKernel` (with the native kernels `native`, if any) where the weight is quantised.
        A tied float head keeps the embedding table for lookups and, when packed, a packed copy.
        `batch_invariant`: every product's rows are computed alike whatever their number."""
        for module in self.modules():
            if hasattr(module, "use_kernel"):
                module.use_kernel(packed, native, batch_invariant)
        quantized_head = self.embed_quantized if self.lm_head is None else self.head_quantized
        if quantized_head is not None:
            self.logits_kernel = QuantizedKernel(quantized_head, None, native, batch_invariant)
            if self.logits_kernel.native is not None:  # it keeps its own copy of the table
                if self.lm_head is None:
                    self.embed_quantized = self.logits_kernel.native
                self.head_quantized = None
            elif self.logits_kernel.dequantize_once and self.lm_head is not None:
                self.head_quantized = None  # the kernel dequantises its own reference on first use
            return
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.logits_kernel = make_kernel(head.data, None, packed, native, batch_invariant)
        if not isinstance(self.logits_kernel, DenseKernel) and self.lm_head is not None:
            self.lm_head.weight = None

    def load_weights(self, weights: Iterable[tuple[str, Any]], quantize_to: Optional[str] = None) -> None:
        """Load Hugging Face-named tensors; raise if any parameter is left unset or a name is unknown.

        Tensors may come as `QuantizedWeight`s (a quantised GGUF) or `W8A8Weight`s (an FP8 or int8 W8A8 checkpoint);
        `quantize_to` ("int8"/"int4"/"fp8") quantises the float ones as well. Projections keep such weights
        packed; the embedding table and the LM head keep a quantised checkpoint's own format, or become int8
        under `quantize_to` int8/int4 (their precision matters most, as in llama.cpp's quantised files);
        under fp8 they stay in the compute dtype, as vLLM keeps them."""
        for module in self.modules():
            if hasattr(module, "quantize_to"):
                module.quantize_to = quantize_to
        params = dict(self.named_parameters())
        if self.arch.tie_word_embeddings:
            params.pop("lm_head.weight", None)
        loaded: set[str] = set()
        if self.arch.architecture == "Llama4ForCausalLM":  # its names, stacked experts and RoPE pairs (first:
            weights = llama4_checkpoint_tensors(weights, self.arch)  # its experts then pass the checks below)
        if self.arch.layer_blocks:  # Nemotron-H's blocks under their layers' names
            weights = nemotron_h_checkpoint_names(weights, self.arch)
        elif self.arch.falcon_h1 is not None:  # Falcon-H1's halves' names, its multipliers folded in
            weights = falcon_h1_checkpoint_tensors(weights, self.arch)
        elif self.arch.mamba_layers is not None:  # Granite 4.0-H's fused expert and shared MLP tensors
            weights = granite_hybrid_checkpoint_names(weights, self.arch)
        if self.arch.gated_deltanet is not None:  # Qwen3-Next's per-head-grouped projections, its mtp.* left out
            weights = qwen3_next_checkpoint_tensors(weights, self.arch)
        if self.arch.moe is not None:  # experts' tensors under the names of the experts' GatedMLPs
            local = local_experts(self.arch.moe.num_experts, self.tp) if self.tp.expert_parallel else None
            weights = expert_checkpoint_names(weights, self.arch.moe, self.arch.hidden_size, local)
            if self.arch.moe.swiglu_limit is not None:  # GPT-OSS: stacked experts, split one by one
                weights = gpt_oss_expert_tensors(weights, self.arch.moe.num_experts, self.arch.hidden_size,
                                                 self.arch.moe.intermediate_size, local)
        weights = split_fused_projections(weights, self.arch)  # Phi-3's qkv_proj and gate_up_proj
        if self.arch.mamba is not None and self.arch.mamba_layers is None:
            weights = mamba2_checkpoint_names(weights)
        vision_weights = []
        for name, tensor in weights:
            if name.startswith("vision."):
                vision_weights.append((name[len("vision."):], tensor))
                continue
            if name == "rope_freqs":
                self.rotary.set_frequency_divisors(tensor)
                continue
            if name.startswith("model."):
                name = name[len("model."):]
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            if "rotary_emb.inv_freq" in name:
                continue
            name = self._local_layer_name(name)
            if name is None:
                # a layer of another pipeline stage, or past the model's last one: the multi-token
                # prediction layers of DeepSeek-V3 / GLM-4.5 (num_nextn_predict_layers), not run here
                continue
            # MLA's q_proj is a projection of its own (models/mla_attention.py), not a shard of qkv_proj
            target, shard = stacked_target(name, fuse_q=self.arch.mla is None)
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {self.arch.architecture}")
            if target in ("embed_tokens.weight", "lm_head.weight"):
                if isinstance(tensor, W8A8Weight) and tensor.values is INT8:
                    tensor = tensor.to_packed_int8()  # the vocabulary matrices keep int8 packed, as ever
                tensor = self._vocab_rows(tensor)
            if target in ("embed_tokens.weight", "lm_head.weight") and (
                    isinstance(tensor, QuantizedWeight) or quantize_to in QUANTIZED_FORMATS):
                self._keep_vocab_matrix_quantized(target, tensor)
                loaded.add(target)
                continue
            loader = getattr(_owner(self, target), "weight_loader", default_weight_loader)
            loader(param, tensor.to(param.dtype) if isinstance(tensor, torch.Tensor) else tensor, shard)
            loaded.add(target if shard is None else f"{target}:{shard}")
        if self.vision is not None:
            self.vision.load_weights(vision_weights)
        elif vision_weights and self.arch.vision is None:  # (a later pipeline stage holds no image side)
            raise ValueError(f"checkpoint has image-side tensors (e.g. {vision_weights[0][0]!r}) but "
                             f"{self.arch.architecture} is a text-only model")
        params = {name: p for name, p in params.items() if not name.startswith("vision.")}
        expected = self._expected_tensor_keys(params)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")

    def _local_layer_name(self, name: str) -> Optional[str]:
        """`name` with its layer index made local to this stage, or None for another stage's layer (or one
        past num_hidden_layers)."""
        if not name.startswith("layers."):
            return name
        index_text, rest = name[len("layers."):].split(".", 1)
        local = int(index_text) - self.first_layer
        if not 0 <= local < len(self.layers):
            return None
        return f"layers.{local}.{rest}"

    def _vocab_rows(self, tensor: Any) -> Any:
        """This rank's rows of a [vocab, hidden] checkpoint tensor (all of it at one rank)."""
        if tuple(tensor.shape) != (self.arch.vocab_size, self.arch.hidden_size):
            raise ValueError(f"weight shape mismatch: checkpoint {tuple(tensor.shape)}, model expects "
                             f"{(self.arch.vocab_size, self.arch.hidden_size)} for the vocabulary matrix")
        if self.tp.size == 1:
            return tensor
        return tensor.narrow(0, self.vocab_start, self.local_vocab)

    def _keep_vocab_matrix_quantized(self, target: str, tensor: Any) -> None:
        packed = (tensor if isinstance(tensor, QuantizedWeight) else quantize(tensor, "int8")).to(self.norm.weight.device)
        if target == "embed_tokens.weight":
            self.embed_quantized = packed
            self.embed_tokens.weight = None
        else:
            self.head_quantized = packed
            self.lm_head.weight = None

    def _expected_tensor_keys(self, params: dict[str, nn.Parameter]) -> set[str]:
        keys: set[str] = set()
        for name in params:
            if ".qkv_proj." in name:
                keys.update(f"{name}:{s}" for s in ("q", "k", "v"))
            elif ".gate_up_proj." in name:
                keys.update(f"{name}:{s}" for s in (0, 1))
            else:
                keys.add(name)
        return keys


def _owner(model: nn.Module, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rsplit(".", 1)[0])
