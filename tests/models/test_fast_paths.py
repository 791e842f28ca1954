"""Every engine fast path keeps greedy output token-identical to the plain one, on mixed batches."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu_kernels import cpu_kernels

PROMPTS = ["The quick brown fox jumps over the lazy dog because", "Hello",
           "A much longer prompt about nothing in particular, repeated. " * 4, "1 2 3 4 5 6 7"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama"))


# a 16-token budget splits the long prompt into chunks that run beside the others' decodes
SMALL_ENGINE = dict(block_size=8, num_kv_blocks=128, max_model_len=512, max_num_batched_tokens=16)


def greedy(path, **options):
    llm = LLM(path, **SMALL_ENGINE, **options)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_native_cpu_backend_matches_the_reference_backend_in_float32(tiny_path):
    plain = greedy(tiny_path, dtype="float32", attention_backend="torch_ref", linear_kernel="dense")
    fast = greedy(tiny_path, dtype="float32", attention_backend="cpu_paged", linear_kernel="auto")
    assert fast == plain
    assert all(len(tokens) == 24 for tokens in fast)


@pytest.mark.parametrize("backend", ["torch_ref", "cpu_paged"])
def test_packed_bfloat16_linears_match_dense_ones(tiny_path, backend):
    # (In bfloat16 the two attention backends legitimately differ in the last bits: SDPA rounds the
    # softmax to bfloat16 before multiplying by V, the native kernel keeps it in float32; the
    # kernel tests bound that difference.)
    dense = greedy(tiny_path, dtype="bfloat16", attention_backend=backend, linear_kernel="dense")
    packed = greedy(tiny_path, dtype="bfloat16", attention_backend=backend, linear_kernel="auto")
    assert packed == dense


def test_unknown_backend_and_kernel_names_are_clear_errors(tiny_path):
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        LLM(tiny_path, attention_backend="flash")
    with pytest.raises(ValueError, match="linear_kernel must be one of"):
        LLM(tiny_path, linear_kernel="int3")


def test_fused_decode_of_bfloat16_weights_in_amx_tiles_gives_the_layer_by_layer_tokens(tiny_path):
    kernels = cpu_kernels()
    if kernels is None or not kernels.amx:
        pytest.skip("bfloat16 weights fuse the decode step only in AMX tiles, which this CPU lacks")
    fused = LLM(tiny_path, dtype="bfloat16", **SMALL_ENGINE)
    assert fused.llm_engine.model.fused_decode is not None
    outputs = [o.outputs[0].token_ids for o in fused.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert outputs == greedy(tiny_path, dtype="bfloat16", fused_decode=False)


def test_fused_step_takes_prefill_chunks_in_bfloat16_and_gives_the_layer_by_layer_tokens(tmp_path):
    kernels = cpu_kernels()
    if kernels is None or not kernels.amx:
        pytest.skip("prefill chunks join the fused step only on the AMX prefill attention, which this CPU lacks")
    path = str(make_tiny_hf_model(tmp_path, arch="llama", hidden_size=128))  # head_dim 32, as the kernel needs
    # a block size the kernel takes; prefill chunks attend as chunks (batch-invariant, every query attends
    # as a decode query and no prefill reaches the kernel)
    engine = {**SMALL_ENGINE, "block_size": 16, "batch_invariant": False}
    llm = LLM(path, dtype="bfloat16", **engine)
    fused, taken = llm.llm_engine.model.fused_decode, []

    class Recording:
        applies = fused.applies

        def __call__(self, hidden, positions, kv_caches, metadata, tap_layers=()):
            out = fused(hidden, positions, kv_caches, metadata, tap_layers)
            taken.append((bool(metadata.prefills), metadata.decode_token_index is not None, out is not None))
            return out

    llm.llm_engine.model.fused_decode = Recording()
    outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    # the first step (prompts only) and a chunk of the long prompt beside decodes each ran as one native call
    assert (True, False, True) in taken and (True, True, True) in taken
    plain = LLM(path, dtype="bfloat16", fused_decode=False, **engine)
    assert outputs == [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_fused_step_hands_eagle3_the_taps_of_the_layer_by_layer_path(tmp_path):
    """EAGLE-3 reads the residual stream entering three of the target's layers. Its verification steps (several
    tokens a request, beside prefill chunks) run as one native call that writes those taps; every step's taps and
    the greedy output are the very bits of the layer-by-layer path."""
    from helpers.agreeing_drafts import write_agreeing_eagle3_head, write_bigram_llama

    target = write_bigram_llama(tmp_path / "target")
    head = write_agreeing_eagle3_head(tmp_path / "head", target)
    runs = {}
    for fused in (True, False):
        llm = LLM(str(target), dtype="bfloat16", quantization="int8", fused_decode=fused, **SMALL_ENGINE,
                  speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3},
                  speculative_min_acceptance=0.0)
        model, taps, native = llm.llm_engine.runner.model, [], []
        assert (model.fused_decode is not None) == fused
        forward = model.forward

        def recording(*args, forward=forward, model=model, taps=taps, **kwargs):
            hidden = forward(*args, **kwargs)
            taps.append(model.aux_hidden.clone())
            return hidden

        model.forward = recording
        if fused:
            step = model.fused_decode

            class Recording:
                applies = step.applies

                def __call__(self, hidden, positions, kv_caches, metadata, tap_layers=()):
                    out = step(hidden, positions, kv_caches, metadata, tap_layers)
                    native.append((hidden.shape[0], bool(tap_layers) and out is not None))
                    return out

            model.fused_decode = Recording()
        outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        runs[fused] = outputs, taps, native
    (outputs, taps, native), (plain_outputs, plain_taps, _) = runs[True], runs[False]
    assert outputs == plain_outputs
    # verification steps of several rows (4 a request) ran natively and kept the taps
    assert any(rows > 4 and kept for rows, kept in native)
    assert len(taps) == len(plain_taps) and all(torch.equal(a, b) for a, b in zip(taps, plain_taps))
