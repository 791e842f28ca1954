"""EAGLE-3 heads and DeepSeek-V3's and GLM-4.5's multi-token prediction layers as speculative drafts: greedy output
identical to no speculation while many proposals are accepted, the incremental draft's proposals equal to a draft
computed from scratch over the accepted sequence (batched, chunked, preempted), the refusals of drafts that do not
fit the target; for GLM-4.5 (the same MTP code as DeepSeek-V3's over another decoder layer), its MTP states against
a reference of vLLM's Glm4MoeMTP on transformers' layer, and its output with the MTP layer drafting in the default
dtype the same bits batched as alone.

Cost: one target per family (tests/helpers/agreeing_drafts.py, written without transformers), one engine with
speculation and one without per family, shared by the tests through the module fixtures `run` / `glm4_moe_run`;
the from-scratch reference runs a tiny one-layer draft over at most 80 positions per proposal; GLM-4.5's batch
invariance two default-dtype engines, its refusals two target loads (~1 s each)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from helpers.agreeing_drafts import (write_agreeing_eagle3_head, write_bigram_deepseek_v3, write_bigram_glm4_moe,
                                     write_bigram_llama)
from helpers.scratch_states import states_from_scratch
from tokenmill import LLM, SamplingParams

PROMPTS = ["Hello there, how", "one two three four five", "The capital of France is", "def f(x):\n    return",
           "a b c d e f", "Why is the sky", "1 2 3 4", "Tell me a story about a dragon who"]
# 8 prompts x 64 tokens (the size): a pool too small for them all (preemptions), 12-token budgets (chunked
# prefills beside verifications), and ~25 verification rounds per request, enough for every accepted length 0..3
MAX_TOKENS = 64
K = 3
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
BLOCK = 16
# a pool of 12 blocks cannot hold the eight requests at once (some are preempted and recomputed, and propose again);
# 12-token budgets chunk the prompts, so prefill chunks run beside other requests' verifications (and a step verifies
# the proposals of the requests its budget has room for)
STRESSED = dict(dtype="float32", quantization="none", block_size=BLOCK, num_kv_blocks=12, max_num_batched_tokens=12,
                max_model_len=80, speculative_max_batch=8, speculative_min_acceptance=0.0)


@dataclasses.dataclass
class Proposal:
    """One request's proposals of one round, as the engine's draft made them."""

    request_id: str
    tokens: list[int]  # the request's sequence when it proposed
    preempted: bool  # whether the request had been preempted (and recomputed) before
    proposals: list[int]
    states: torch.Tensor  # [len(proposals), hidden]: the draft's states whose logits gave them


@dataclasses.dataclass
class SpeculativeRun:
    """A family's greedy outputs with speculation and without, and what the draft did meanwhile."""

    llm: LLM
    outputs: dict[str, list[int]]  # request id -> prompt and output ids
    spec_output: list[list[int]]
    plain_output: list[list[int]]
    proposals: list[Proposal]
    accepted: list[int]  # accepted proposals of each verification round
    # (target model, draft, the target's final states) -> the draft's hidden rows of the target's last forward pass
    target_rows: Callable[[Any, Any, torch.Tensor], torch.Tensor]


def _record_proposals(proposer, proposals: list[Proposal]) -> None:
    """Make the engine's DraftProposer record each round's proposals and the states their logits came from."""
    propose, model = proposer.propose, proposer.runner.model
    compute_logits = model.compute_logits

    def recording(wanted):
        passes = []  # the states of each draft pass

        def recorded_logits(states):
            passes.append(states.clone())
            return compute_logits(states)

        model.compute_logits = recorded_logits
        try:
            drafts = propose(wanted)
        finally:
            del model.compute_logits
        # pass s computes the states of the requests with more than s proposals, in the order of `drafts`
        states = {rid: [] for rid in drafts}
        for step, rows in enumerate(passes):
            for rid, row in zip([rid for rid, draft in drafts.items() if len(draft.token_ids) > step], rows):
                states[rid].append(row)
        for request, _ in wanted:
            rid = request.request_id
            if rid in drafts:
                proposals.append(Proposal(rid, request.token_ids_range(0, request.num_tokens),
                                          request.num_preemptions > 0, list(drafts[rid].token_ids),
                                          torch.stack(states[rid])))
        return drafts

    proposer.propose = recording


def _run(path: Path, speculative_config: dict, target_rows) -> SpeculativeRun:
    plain = LLM(str(path), dtype="float32", quantization="none").generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(str(path), **STRESSED, speculative_config={**speculative_config, "num_speculative_tokens": K})
    speculation = llm.llm_engine.speculation
    proposals, accepted = [], []
    _record_proposals(speculation.proposer, proposals)
    observe = speculation.observe

    def recording(updates):
        updates = list(updates)
        accepted.extend(update.num_accepted_tokens for update in updates if update.num_draft_tokens)
        observe(updates)

    speculation.observe = recording
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return SpeculativeRun(llm, {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs},
                          [o.outputs[0].token_ids for o in outputs], [o.outputs[0].token_ids for o in plain],
                          proposals, accepted, target_rows)


@pytest.fixture(scope="module")
def llama_target(tmp_path_factory) -> Path:
    return write_bigram_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def eagle3_head(tmp_path_factory, llama_target) -> Path:
    return write_agreeing_eagle3_head(tmp_path_factory.mktemp("eagle3"), llama_target)


@pytest.fixture(scope="module")
def glm4_moe_target(tmp_path_factory) -> Path:
    return write_bigram_glm4_moe(tmp_path_factory.mktemp("glm4_moe"))


@pytest.fixture(scope="module")
def glm4_moe_run(glm4_moe_target) -> SpeculativeRun:
    """GLM-4.5's run (also read by the reference test below), asking for vLLM's method name (the same as "mtp")."""
    return _run(glm4_moe_target, {"method": "glm4_moe_mtp"}, lambda model, draft, hidden: hidden)


@pytest.fixture(scope="module", params=["eagle3", "deepseek_v3_mtp", "glm4_moe_mtp"])
def run(request, tmp_path_factory) -> SpeculativeRun:
    if request.param == "eagle3":
        target, head = request.getfixturevalue("llama_target"), request.getfixturevalue("eagle3_head")
        # the head's rows: fc of the target's three taps
        return _run(target, {"method": "eagle3", "model": str(head)},
                    lambda model, draft, hidden: draft.combine(model.aux_hidden))
    if request.param == "glm4_moe_mtp":
        return request.getfixturevalue("glm4_moe_run")
    target = write_bigram_deepseek_v3(tmp_path_factory.mktemp("dsv3"))
    return _run(target, {"method": "mtp"}, lambda model, draft, hidden: hidden)  # the target's final states


def test_greedy_output_is_identical_to_no_speculation_while_many_proposals_are_accepted(run):
    assert run.spec_output == run.plain_output
    stats = run.llm.llm_engine.stats()
    assert stats.num_preemptions > 0
    # over a third of the proposals are accepted, and every length from none to all K occurs: partial acceptances
    # (the draft's KV and held hidden rows cut back) and full ones
    assert sum(run.accepted) > K * len(run.accepted) / 3
    assert set(run.accepted) == set(range(K + 1))
    proposer = run.llm.llm_engine.speculation.proposer
    assert proposer.kv.pool.num_used_blocks == 0  # every finished request freed its draft KV
    assert not proposer.hidden._held  # and its held hidden states


def _from_scratch(runner) -> Callable[..., torch.Tensor]:
    """f(tokens, step_hidden=None): `runner`'s model's final states over `tokens`, from scratch."""
    return states_from_scratch(runner, BLOCK, STRESSED["max_model_len"] + K)


@torch.inference_mode()
def test_incremental_draft_proposes_what_a_draft_computed_from_scratch_does(run):
    """After partial acceptances, rejections, chunked prefills and recompute preemptions, every proposal and the state
    it came from equal a from-scratch computation: the target over the accepted sequence gives the hidden rows, the
    draft then runs over positions 0..n-2 (fed tokens 1..n-1 and those rows), then once more per chained proposal
    (fed the proposal and its own previous state). A draft KV entry or hidden row kept or dropped wrongly changes the
    states (the head's attention reads the whole prefix, its hidden inputs go into every state)."""
    engine = run.llm.llm_engine
    target, draft = engine.runner.model, engine.speculation.proposer.runner.model
    target_states, draft_states = _from_scratch(engine.runner), _from_scratch(engine.speculation.proposer.runner)
    rows = {rid: run.target_rows(target, draft, target_states(sequence)) for rid, sequence in run.outputs.items()}
    assert any(p.preempted for p in run.proposals) and len({p.request_id for p in run.proposals}) == len(PROMPTS)
    for proposal in run.proposals:
        sequence, n = run.outputs[proposal.request_id], len(proposal.tokens)
        assert proposal.tokens == sequence[:n]
        fed, hidden = list(sequence[1:n]), rows[proposal.request_id][:n - 1]
        for index, token in enumerate(proposal.proposals):
            state = draft_states(fed, hidden)[-1:]
            # (torch.allclose: assert_close's checks cost more than the draft's forward pass)
            assert torch.allclose(proposal.states[index:index + 1], state, rtol=1e-4, atol=1e-4), \
                f"{proposal}: state {index} is {(proposal.states[index] - state).abs().max()} from scratch's"
            assert token == int(draft.compute_logits(state).argmax())
            fed.append(token)
            hidden = torch.cat([hidden, state])


def test_drafts_that_do_not_fit_the_target_are_refused(llama_target, eagle3_head, tmp_path):
    engine = dict(dtype="float32", quantization="none")
    with pytest.raises(ValueError, match="'mtp' runs the multi-token prediction layers of DeepseekV3ForCausalLM, "
                                         "Glm4MoeForCausalLM, Qwen3NextForCausalLM; LlamaForCausalLM is not supported"):
        LLM(str(llama_target), **engine, speculative_config={"method": "mtp"})
    config = json.loads((eagle3_head / "config.json").read_text())

    def head(name: str, **changes) -> str:  # the refusals come before any weight is read: a config.json suffices
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
        return str(folder)

    with pytest.raises(ValueError, match="vocab_size 1000 is not the target's 49152"):
        LLM(str(llama_target), **engine, speculative_config={"method": "eagle3", "model": head(
            "small", vocab_size=1000, draft_vocab_size=100)})
    with pytest.raises(ValueError, match=r"three distinct layers of the target's 4; the layer ids \[2, 2, 1\]"):
        LLM(str(llama_target), **engine, speculative_config={"method": "eagle3", "model": head(
            "default", eagle_aux_hidden_state_layer_ids=None)})
    with pytest.raises(ValueError, match="architectures"):
        LLM(str(llama_target), **engine, speculative_config={"method": "eagle3", "model": str(llama_target)})


def test_glm4_moe_mtp_refuses_a_checkpoint_without_a_complete_mtp_layer(glm4_moe_target, tmp_path):
    from safetensors.torch import load_file, save_file

    def variant(name: str) -> Path:  # the target's files, linked, but for those the test writes
        folder = tmp_path / name
        folder.mkdir()
        for file in glm4_moe_target.iterdir():
            if file.name not in ("config.json", "model.safetensors"):
                (folder / file.name).symlink_to(file)
        return folder

    engine = dict(dtype="float32", quantization="none", speculative_config={"method": "mtp"})
    without = variant("without")
    config = json.loads((glm4_moe_target / "config.json").read_text())
    (without / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    (without / "model.safetensors").symlink_to(glm4_moe_target / "model.safetensors")
    with pytest.raises(ValueError, match="config has no num_nextn_predict_layers"):
        LLM(str(without), **engine)
    incomplete = variant("incomplete")
    (incomplete / "config.json").symlink_to(glm4_moe_target / "config.json")
    tensors = load_file(str(glm4_moe_target / "model.safetensors"))
    save_file({name: t for name, t in tensors.items() if name != "model.layers.2.eh_proj.weight"},
              str(incomplete / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no complete multi-token prediction layer model\.layers\.2\.\* \(missing "
                                         r"\['eh_proj\.weight'\]\)"):
        LLM(str(incomplete), **engine)


def test_glm4_moe_output_with_mtp_in_the_default_dtype_is_the_same_batched_as_alone(glm4_moe_target):
    """Batch invariance with the MTP layer drafting, in this CPU's default dtype and kernels: each prompt's greedy ids
    and top-2 logprobs, run alone without speculation, equal its result among the 8 batched with speculation,
    chunked and preempted. (Costs two more engines on the shared tiny target, ~3 s: 24 tokens a request.)"""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    alone = LLM(str(glm4_moe_target), prefix_caching=False)
    expected = [_ids_and_logprobs(alone.generate([prompt], params, use_tqdm=False)[0]) for prompt in PROMPTS]
    alone.shutdown()
    stressed = {key: value for key, value in STRESSED.items() if key not in ("dtype", "quantization")}
    stressed.update(num_kv_blocks=5, max_model_len=48)  # 5 blocks: preemptions at 24 tokens a request
    busy = LLM(str(glm4_moe_target), **stressed, speculative_config={"method": "mtp", "num_speculative_tokens": K})
    outputs = busy.generate(PROMPTS, params, use_tqdm=False)
    stats = busy.llm_engine.stats()
    assert stats.num_preemptions > 0 and 0 < stats.spec.accepted_tokens < stats.spec.draft_tokens
    assert [_ids_and_logprobs(output) for output in outputs] == expected


def _ids_and_logprobs(output) -> tuple:
    completion = output.outputs[0]
    return tuple(completion.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in step.items()))
                                              for step in completion.logprobs)


@torch.inference_mode()
def test_glm4_moe_mtp_layer_computes_what_vllms_glm4_moe_mtp_does(glm4_moe_target, glm4_moe_run):
    """The draft's states equal a float32 reference of vLLM's Glm4MoeMultiTokenPredictorLayer built on transformers'
    GLM-4.5: the target's final (normed) hidden states h, the embedding of the next token zeroed at position 0,
    eh_proj(concat(enorm(embedding), hnorm(h))) through transformers' decoder layer 2 (a MoE layer: 2 >=
    first_k_dense_replace), its output (residual included) the chained state; shared_head's norm and head give the
    logits. Proves partial RoPE, q/k norm, the biases and the experts of the MTP block, which the tests above do not
    tell apart from a draft that merely agrees with itself. (A tiny transformers model, ~1 s: transformers is
    imported by most of the suite's test files already.)"""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tokens = [5, 900, 17, 4242, 33, 1000, 77, 12, 600, 41, 8, 3000]  # past a 16-dim rotary's first turns
    n = len(tokens)
    engine = glm4_moe_run.llm.llm_engine  # (float32)
    hidden = _from_scratch(engine.runner)(tokens)
    states = _from_scratch(engine.speculation.proposer.runner)(tokens[1:], hidden[:n - 1])
    logits = engine.speculation.proposer.runner.model.compute_logits(states)

    hf = AutoModelForCausalLM.from_pretrained(glm4_moe_target, dtype=torch.float32, attn_implementation="sdpa",
                                              num_hidden_layers=3)  # layer 2: the MTP layer's decoder block
    x = hf.model.embed_tokens(torch.tensor([tokens]))
    rope = hf.model.rotary_emb(x, torch.arange(n)[None])
    for layer in hf.model.layers[:2]:  # (attention_mask None: sdpa's causal mask)
        x = layer(x, position_embeddings=rope)
    hf_hidden = hf.model.norm(x)[0]
    torch.testing.assert_close(hidden, hf_hidden, rtol=1e-4, atol=1e-4)
    mtp = {name[len("model.layers.2."):]: t for name, t in load_file(str(glm4_moe_target / "model.safetensors")).items()
           if name.startswith("model.layers.2.")}
    eps = hf.config.rms_norm_eps

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    embeds = hf.model.embed_tokens(torch.tensor(tokens[1:]))
    embeds[0] = 0  # position 0: nothing precedes it
    x = torch.cat([rms(embeds, mtp["enorm.weight"]), rms(hf_hidden[:n - 1], mtp["hnorm.weight"])], -1)
    x = (x @ mtp["eh_proj.weight"].T)[None]
    expected = hf.model.layers[2](x, position_embeddings=hf.model.rotary_emb(x, torch.arange(n - 1)[None]))[0]
    torch.testing.assert_close(states, expected, rtol=1e-4, atol=1e-4)
    expected_logits = rms(expected, mtp["shared_head.norm.weight"]) @ mtp["shared_head.head.weight"].T
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
