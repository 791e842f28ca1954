"""The roofline columns' counting (tokenmill/bench/roofline.py): the weight bytes a decode step reads are the
checkpoint's less the embedding table (float32), half of them in bfloat16 (a packed copy beside the original
counted once), fewer again in int8; prefill arithmetic counts the projections per token, the LM head per sampled
row and attention per causal (query, key) pair; the step log tells decode-only steps from those with prefill
chunks. Cost: three engines of a tiny checkpoint written without transformers (~1 s)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from helpers.agreeing_drafts import write_bigram_llama
from tokenmill import LLM, SamplingParams
from tokenmill.bench.roofline import StepLog, prefill_flops, projection_macs_per_token, weight_bytes_per_step


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_bigram_llama(tmp_path_factory.mktemp("bigram"))


def test_a_decode_step_reads_every_weight_once_as_its_product_keeps_it(checkpoint):
    tensors = load_file(str(checkpoint / "model.safetensors"))  # float32, embeddings untied
    projections = sum(t.numel() for name, t in tensors.items() if name.endswith("_proj.weight"))
    read = {}
    for dtype, quantization in (("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8")):
        model = LLM(str(checkpoint), dtype=dtype, quantization=quantization, num_kv_blocks=8).llm_engine.runner.model
        read[dtype, quantization] = weight_bytes_per_step(model)
        assert projection_macs_per_token(model.arch, model) == projections
    assert read["float32", "none"] == sum(t.numel() * 4 for name, t in tensors.items() if "embed_tokens" not in name)
    assert read["bfloat16", "none"] == read["float32", "none"] // 2
    assert read["bfloat16", "int8"] < 0.6 * read["bfloat16", "none"]  # one byte a weight and the blocks' scales


def test_prefill_arithmetic_and_the_step_log(checkpoint):
    llm = LLM(str(checkpoint), dtype="float32", quantization="none", num_kv_blocks=16, max_num_batched_tokens=8)
    engine, model = llm.llm_engine, llm.llm_engine.runner.model
    arch = engine.arch
    macs = projection_macs_per_token(arch, model)
    # a 5-token chunk from position 3 (sampled) and a decode at position 9: 6 tokens, 1 sampled row, and
    # 5 x 3 + 15 + 10 causal (query, key) pairs
    pairs = 5 * 3 + 5 * 6 // 2 + 10
    want = 2 * (macs * 6 + arch.hidden_size * arch.vocab_size) + \
        4 * arch.num_attention_heads * arch.head_dim * pairs * arch.num_hidden_layers
    assert prefill_flops(arch, model, [(3, 5, True), (9, 1, False)]) == want
    log = StepLog.attach(engine)
    llm.generate([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]], SamplingParams(max_tokens=3, ignore_eos=True),
                 use_tqdm=False)
    # an 8-token budget: chunks of 8 and 4 (the second samples), then two decode steps
    assert [chunks for _, chunks in log.prefill_steps()] == [[(0, 8, False)], [(8, 4, True)]]
    assert len(log.decode_seconds()) == 2
