"""Models with weight-only quantised linears: which weights stay packed, and that the native products
score prompts as the PyTorch reference product does.

The two differ only in float32 summation order, which is enough to flip a near-tie between two tokens
of a tiny random model, so they are compared by log-probabilities rather than by greedy tokens."""

from __future__ import annotations

import pytest

from helpers.tiny_gguf import write_tiny_gguf
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.layers.linear import _ShardedLinear
from tokenmill.kernels import quantized

PROMPTS = ["The quick brown fox jumps over the lazy dog because", "Hello",
           "A much longer prompt about nothing in particular, repeated. " * 4, "1 2 3 4 5 6 7"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def build(path, **options) -> LLM:
    # a 16-token budget splits the long prompt into chunks that run beside the others' decodes
    return LLM(str(path), **{"block_size": 8, "num_kv_blocks": 128, "max_model_len": 256,
                             "max_num_batched_tokens": 16, **options})


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def prompt_scores(llm: LLM) -> list[float]:
    """The log-probability of every prompt token after its prefix, one prompt at a time."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    scores = []
    for prompt in PROMPTS:
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        scores += [position[token].logprob for position, token in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
    return scores


def assert_same_scores(llm: LLM, reference: LLM) -> None:
    # Products of few rows quantise their input. There a last-bit difference can move an input value
    # across a rounding boundary of the next layer's input quantisation (one step in 127 of its
    # block), so the two agree to 1% (measured: 0.1%), not to float32 precision.
    assert prompt_scores(llm) == pytest.approx(prompt_scores(reference), rel=1e-2)


def linear_formats(llm: LLM) -> set:
    model = llm.llm_engine.model
    return {m.quantized_format for m in model.modules() if isinstance(m, _ShardedLinear)}


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama")


@pytest.mark.every_level
@pytest.mark.parametrize("tensor_type, fmt", [("Q8_0", "int8"), ("Q4_0", "int4"), ("Q4_1", "int4"),
                                              ("Q4_K", "int4")])
def test_quantised_gguf_stays_packed_and_native_matches_reference(tmp_path, tensor_type, fmt):
    path = write_tiny_gguf(tmp_path / f"tiny-{tensor_type}.gguf", tensor_type)
    fast = build(path, dtype="float32")
    assert linear_formats(fast) == {fmt}
    assert fast.llm_engine.model.embed_quantized.format == fmt  # the tied embedding too
    reference = build(path, dtype="float32", linear_kernel="dense")
    assert_same_scores(fast, reference)
    # an 8-token budget keeps every product below the dequantising threshold: the int8 kernel path
    assert_same_scores(build(path, dtype="float32", max_num_batched_tokens=8),
                       build(path, dtype="float32", max_num_batched_tokens=8, linear_kernel="dense"))
    assert linear_formats(build(path, dtype="float32", quantization="none")) == {None}


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_float_checkpoint_quantised_at_load(tiny_hf, fmt):
    llm = build(tiny_hf, dtype="float32", quantization=fmt)
    model = llm.llm_engine.model
    assert linear_formats(llm) == {fmt}
    assert model.logits_kernel.format == "int8"  # the untied head keeps 8 bits
    assert all(m.weight is None for m in model.modules() if isinstance(m, _ShardedLinear))
    assert_same_scores(llm, build(tiny_hf, dtype="float32", quantization=fmt, linear_kernel="dense"))
    assert all(len(tokens) == 24 for tokens in greedy(llm))


def test_bfloat16_quantised_model_generates(tiny_hf):
    llm = build(tiny_hf, dtype="bfloat16", quantization="int4")
    assert all(len(tokens) == 24 for tokens in greedy(llm))


def test_unknown_quantization_is_a_clear_error(tiny_hf):
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(tiny_hf), quantization="int3")


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])  # qwen2: biased q/k/v projections
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_fused_decode_step_gives_the_tokens_of_the_layer_by_layer_path(tmp_path, architecture, batch_invariant,
                                                                       monkeypatch):
    # four prompts decode at most four rows at a time: move the AMX threshold so both paths run
    monkeypatch.setattr(quantized, "AMX_FROM_ROWS", 3)
    path = write_tiny_gguf(tmp_path / f"{architecture}.gguf", "Q4_1", architecture=architecture)
    fused = build(path, dtype="bfloat16", batch_invariant=batch_invariant)
    model = fused.llm_engine.model
    assert model.fused_decode is not None
    decisions, fused_rows = [], []
    applies = model.fused_decode.applies

    def recorded(metadata, num_tokens):
        decisions.append(applies(metadata, num_tokens))
        fused_rows.extend([num_tokens] if decisions[-1] else [])
        return decisions[-1]

    model.fused_decode.applies = recorded
    outputs = greedy(fused)
    if batch_invariant:  # every step, prefills included, is decode queries on the int8 products
        assert all(decisions) and max(fused_rows) > 4
    else:
        assert any(decisions) and not all(decisions)  # pure decode steps fused, mixed ones layer by layer
        # fused steps of 1-2 rows take the int8 products and of 3-4 the AMX ones (on a CPU with AMX)
        assert min(fused_rows) < quantized.AMX_FROM_ROWS <= max(fused_rows)
    assert outputs == greedy(build(path, dtype="bfloat16", fused_decode=False, batch_invariant=batch_invariant))


def test_a_float32_fused_step_attends_every_query_as_the_layer_by_layer_path_does(tmp_path):
    """Float32, batch-invariant: on AMX the step's chunks are built for the bfloat16 tiles, which float32
    does not take; the fused step then attends every query as a decode, as the module path's layers
    do, and still runs every step."""
    path = write_tiny_gguf(tmp_path / "llama.gguf", "Q4_1")
    fused = build(path, dtype="float32", batch_invariant=True)
    model = fused.llm_engine.model
    assert model.fused_decode is not None
    applies, decisions = model.fused_decode.applies, []
    model.fused_decode.applies = lambda metadata, rows: decisions.append(applies(metadata, rows)) or decisions[-1]
    outputs = greedy(fused)
    assert decisions and all(decisions)
    assert outputs == greedy(build(path, dtype="float32", fused_decode=False, batch_invariant=True))
