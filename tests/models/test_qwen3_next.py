"""Qwen3-Next (Qwen3NextForCausalLM): a tiny random checkpoint (3 layers, Gated DeltaNet - gated attention - Gated
DeltaNet, hidden 64, 4 experts plus the gated shared expert, a dense last layer, random zero-centred norm weights,
and a multi-token prediction layer's tensors as the real checkpoints carry them) gives HF float32's greedy ids and
logprobs plain, chunked, preempted (swapped out and back) and batched (8 prompts x 32 tokens, one of 90 tokens
whose prefill crosses the rule's 64-token chunks); its states carry across chunks split at every boundary and restart after a recompute
preemption (the one pass's ids) with its attention layer on the reference and Triton backends; a request's output
in the default dtype does not depend on its batch; the chunked gated delta rule equals the token-by-token one from a
carried state; speculation gives the same bits as none (proposals of every accepted length, the states rolled back);
its MTP layer drafts (greedy output unchanged) and computes what vLLM's Qwen3NextMTP does; unsupported settings are
refused.

HF's oracle runs its own torch kernels: transformers picks flash-linear-attention's Triton kernels when fla is
installed, which do not run on a CPU, and importing fla costs 5-10 s (the fixtures keep it out). No test runs
tokenmill's fla path (CUDA only): its recurrent kernel matches the torch rule in Triton's interpreter, but importing
fla alone would cost this file as much again, and its chunked kernel does not run in the interpreter.
Cost: the checkpoint and HF model are built once per module; check_family about 5 s, the rest small engines of 6-12
tokens a request."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.engine_probe import EIGHT_PROMPTS
from helpers.family_check import check_family
from helpers.forced_preemption import OTHERS, PROMPT, greedy_runs
from helpers.scripted_proposals import assert_speculation_changes_no_bit
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM
from tokenmill.layers.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from tokenmill.models.loader.hf_qwen3_next import qwen3_next_arch_config
from tokenmill.worker.worker import check_divisible


def _add_mtp_layer(folder) -> None:
    """A multi-token prediction layer as Qwen3-Next's checkpoints store it (mtp.*, which transformers' classes drop):
    its decoder block a copy of layer 1's tensors (gated full attention, the experts: the kind vLLM builds it of), its
    two input norms, fc and final norm random; num_nextn_predict_layers 1 in config.json."""
    import json

    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    tensors = load_file(file)
    hidden = tensors["model.norm.weight"].shape[0]
    generator = torch.Generator().manual_seed(3)
    extra = {"mtp." + name: 0.1 * torch.randn(hidden, generator=generator)  # (1 + w norms)
             for name in ("norm.weight", "pre_fc_norm_hidden.weight", "pre_fc_norm_embedding.weight")}
    extra["mtp.fc.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=generator)
    extra.update({"mtp.layers.0." + name[len("model.layers.1."):]: tensor.clone()
                  for name, tensor in tensors.items() if name.startswith("model.layers.1.")})
    save_file({**tensors, **extra}, file, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))


def _import_transformers_qwen3_next_without_fla() -> None:
    """transformers looks for fla as its Qwen3-Next module is first imported (by the first model it builds): make
    that look fail, so it keeps its torch kernels and the 5-10 s import of fla is not paid."""
    import sys

    blocked = {name: sys.modules.get(name) for name in ("fla", "causal_conv1d")}
    sys.modules.update(dict.fromkeys(blocked))
    try:
        import transformers.models.qwen3_next.modeling_qwen3_next  # noqa: F401
    finally:
        for name, module in blocked.items():
            if module is None:
                del sys.modules[name]
            else:
                sys.modules[name] = module


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    _import_transformers_qwen3_next_without_fla()
    path = make_tiny_hf_model(tmp_path_factory.mktemp("qwen3_next"), arch="qwen3_next")
    _add_mtp_layer(path)
    return path


@pytest.fixture(scope="module")
def hf(folder):
    from transformers.models.qwen3_next import modeling_qwen3_next as modeling

    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):  # its own torch kernels (had fla been imported before, it would be fla's)
        setattr(modeling, name, getattr(modeling, name).__wrapped__)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_qwen3_next_matches_hf_plain_chunked_preempted_and_batched(folder, hf, caplog):
    with caplog.at_level(logging.INFO):
        # the preempted requests swap their state pages and K/V out and back (core/swap_space.py)
        counts = check_family(folder, hf, prefix_caching=False, preemption_mode="swap")
    assert counts["preemptions"] > 0  # the attention group's growth preempts (check_family asserts it too)
    assert "prefix caching is off: Qwen3NextForCausalLM keeps a recurrent state" in caplog.text
    assert "its multi-token prediction layer (29 mtp.* tensors) is not part of the target" in caplog.text


def test_qwen3_next_chunks_at_every_boundary_and_a_preempted_request_give_one_pass_ids(folder):
    """One-token chunks split the prompt at every boundary (the rule's one-token form throughout); a preemption
    mid-prefill drops the request's blocks (states and K/V) and it recomputes from zero, here with the attention
    layer on the reference backend; and Triton's (in its interpreter, whole prompts: 2 s of its kernels) runs it
    beside states kept in its cache tensors. Float32: the one pass's ids, logprobs within float32 noise."""
    prompts = [PROMPT, OTHERS[0]]
    one_pass = greedy_runs(LLM(str(folder), dtype="float32", num_kv_blocks=32), prompts, max_tokens=6)
    every_boundary = greedy_runs(LLM(str(folder), dtype="float32", num_kv_blocks=32, max_num_batched_tokens=1),
                                 prompts, max_tokens=6)
    preempted = greedy_runs(LLM(str(folder), dtype="float32", num_kv_blocks=32, max_num_batched_tokens=7,
                                attention_backend="torch_ref", preemption_mode="recompute"),
                            prompts, preempt_at_step=3, max_tokens=6)
    triton = greedy_runs(LLM(str(folder), dtype="float32", num_kv_blocks=32, attention_backend="triton_paged",
                             linear_kernel="dense"), prompts, max_tokens=6)
    for run in (every_boundary, preempted, triton):
        for (ids, logprobs), (want_ids, want_logprobs) in zip(run, one_pass):
            assert ids == want_ids
            worst = max(abs(a[1] - b[1]) for x, y in zip(logprobs, want_logprobs) for a, b in zip(x, y))
            assert worst < 1e-4


def test_qwen3_next_output_does_not_depend_on_its_batch_in_the_default_dtype(folder):
    alone = greedy_runs(LLM(str(folder), num_kv_blocks=32), [PROMPT])[0]
    busy = LLM(str(folder), num_kv_blocks=24, max_num_batched_tokens=5)  # 5-token chunks, a preemption forced
    batched = greedy_runs(busy, [OTHERS[0], PROMPT, *OTHERS[1:]], preempt_at_step=4)
    assert batched[1] == alone  # the same bits


def _rule_inputs(T: int, heads: int = 3, dk: int = 8, dv: int = 5):
    torch.manual_seed(1)
    q = torch.nn.functional.normalize(torch.randn(T, heads, dk), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(T, heads, dk), dim=-1)
    return (q, k, torch.randn(T, heads, dv), -torch.rand(T, heads), torch.rand(T, heads),
            torch.randn(heads, dk, dv))


def test_the_chunked_rule_equals_the_recurrence_from_a_carried_state():
    q, k, v, g, beta, state = _rule_inputs(37)
    want, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    # chunks of 8: four whole ones and a padded fifth, the state carried between them; and in two calls of 20 + 17
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=8)
    first, middle = chunk_gated_delta_rule(q[:20], k[:20], v[:20], g[:20], beta[:20], state, chunk_size=8)
    second, split_final = chunk_gated_delta_rule(q[20:], k[20:], v[20:], g[20:], beta[20:], middle, chunk_size=8)
    for got, expected in ((out, want), (final, want_state), (torch.cat([first, second]), want),
                          (split_final, want_state)):
        assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


@pytest.mark.parametrize("setting,named", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_hidden_layers": 2, "layer_types": ["linear_attention", "sliding_attention"]}, "layer types"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "RoPE scaling"),
    ({"linear_num_key_heads": 3, "linear_num_value_heads": 4}, "linear_num_value_heads"),
    ({"head_dim": 32, "partial_rotary_factor": 0.1}, "partial_rotary_factor"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
])
def test_unsupported_qwen3_next_settings_are_refused(setting, named):
    with pytest.raises(ValueError, match=named):
        qwen3_next_arch_config(setting, {}, lambda: "float32")


def test_qwen3_next_tensor_parallelism_a_quantised_cache_and_lora_are_refused(folder):
    arch = qwen3_next_arch_config({"num_hidden_layers": 4}, {}, lambda: "float32")
    assert arch.gated_deltanet_layers == {0, 1, 2}  # (every 4th layer full attention by default)
    with pytest.raises(ValueError, match="tensor_parallel_size 1 .* Gated DeltaNet mixers are not sharded"):
        check_divisible(arch, 2)
    with pytest.raises(ValueError, match="kv_cache_dtype int8: Qwen3NextForCausalLM's recurrent states"):
        LLM(str(folder), kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="enable_lora: .* Qwen3NextForCausalLM has .* recurrent mixers"):
        LLM(str(folder), enable_lora=True)


def test_speculation_keeps_the_states_of_accepted_proposals_only(folder):
    """Verified proposals run one at a time through the Gated DeltaNet rule; the state after the accepted ones is
    kept."""
    assert_speculation_changes_no_bit(str(folder), dict(num_kv_blocks=32))


@torch.inference_mode()
def test_qwen3_next_mtp_drafts_what_vllms_qwen3_next_mtp_computes(folder, hf):
    """speculative_method mtp drafts with the mtp.* layer: greedy output identical to no speculation (the target's
    states rolled back past rejected proposals), 8 prompts x 64 tokens batched in a pool too small for them (swap
    preemptions) with 12-token budgets; and the draft's states and logits equal a float32 reference of
    vLLM's Qwen3NextMultiTokenPredictor built on transformers' Qwen3-Next: the target's final (normed) hidden states
    h, fc(concat(pre_fc_norm_embedding(embedding of the next token), pre_fc_norm_hidden(h))) (no position zeroed)
    through the decoder block (transformers' layer 1: gated full attention and the experts, whose tensors the MTP
    block copies), then its norm (1 + w) gives the chained state, the model's lm_head the logits."""
    from helpers.scratch_states import states_from_scratch
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in EIGHT_PROMPTS]
    plain = LLM(str(folder), dtype="float32", num_kv_blocks=128).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=40, max_num_batched_tokens=12, preemption_mode="swap",
              speculative_min_acceptance=0.0, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    drafted = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    stats = llm.llm_engine.stats()
    assert stats.spec.draft_tokens > 0 and stats.num_preemptions > 0, stats

    tokens = [5, 900, 17, 4242, 33, 1000, 77, 12, 600, 41, 8, 3000]
    n, draft = len(tokens), llm.llm_engine.speculation.proposer.runner
    hf_hidden = hf.model(torch.tensor([tokens])).last_hidden_state[0]  # (the target's own are check_family's)
    states = states_from_scratch(draft, 16, 64)(tokens[1:], hf_hidden[:n - 1])
    logits = draft.model.compute_logits(states)

    from safetensors.torch import load_file

    mtp = {name[len("mtp."):]: t for name, t in load_file(str(folder / "model.safetensors")).items()
           if name.startswith("mtp.")}
    eps = hf.config.rms_norm_eps

    def norm(weight):
        module = Qwen3NextRMSNorm(weight.shape[0], eps=eps)
        module.weight.data.copy_(weight)
        return module

    embeds = hf.model.embed_tokens(torch.tensor(tokens[1:]))
    x = torch.cat([norm(mtp["pre_fc_norm_embedding.weight"])(embeds),
                   norm(mtp["pre_fc_norm_hidden.weight"])(hf_hidden[:n - 1])], -1)
    x = (x @ mtp["fc.weight"].T)[None]
    block = hf.model.layers[1]  # (the MTP block's tensors are its copies)
    out = block(x, position_embeddings=hf.model.rotary_emb(x, torch.arange(n - 1)[None]), attention_mask=None)
    expected = norm(mtp["norm.weight"])(out[0] if isinstance(out, tuple) else out)[0]
    torch.testing.assert_close(states, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, hf.lm_head(expected), rtol=1e-4, atol=1e-4)
