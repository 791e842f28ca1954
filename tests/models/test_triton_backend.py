"""The Triton backend end to end: tiny random models run on `triton_paged` in Triton's interpreter (CPU
tensors) and give the reference backend's greedy tokens, through chunked prefill and prefix-cache hits."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.attention import get_attention_backend
from tokenmill.config import ModelConfig
from tokenmill.layers.linear_kernels import InvariantDenseKernel
from tokenmill.layers.triton_fused import TritonFusedOps
from tokenmill.layers.triton_products import TritonProducts
from tokenmill.worker.model_setup import choose_kernels, resolve_batch_invariant

PROMPTS = ["The quick brown fox jumps over the lazy dog because", "Hello",
           "A much longer prompt about nothing in particular, repeated. " * 3, "1 2 3 4 5 6 7"]
# Triton's interpreter runs every kernel program in Python, so each step counts: 8 tokens still take the first
# prompt (10 tokens) past the gemma window of 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
# a 16-token budget splits the long prompt into chunks that run beside the others' decodes
ENGINE = dict(dtype="float32", linear_kernel="dense", block_size=8, num_kv_blocks=96, max_model_len=256,
              max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random Llama (the engines that load it are each the test's own): one layer and one KV head (its 4
    query heads still grouped), since the interpreter runs an attention program per KV head and layer."""
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("llama"), arch="llama", num_hidden_layers=1,
                                  num_key_value_heads=1))


def run(path, backend, prompts=PROMPTS):
    llm = LLM(path, attention_backend=backend, **ENGINE)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    # the same prompt: a prefix-cache hit, its tail's prefill and decodes reading the cached block
    again = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    return llm, first, again


# Gemma 3: a sliding layer and a full one (two of the tiny model's six layers) and one KV head for its 4 query
# heads (the interpreter's time goes with the layers and the KV heads), head_dim 32; DeepSeek-V2: MLA, one
# (dense) layer of the two (llama: the GPU check's dry run)
SHAPES = {"gemma3_text": dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                              num_key_value_heads=1),
          "deepseek_v2": dict(num_hidden_layers=1, first_k_dense_replace=1)}


@pytest.mark.parametrize("arch", list(SHAPES))
def test_tiny_models_give_the_reference_tokens_on_the_triton_backend(tmp_path, arch):
    path = str(make_tiny_hf_model(tmp_path, arch=arch, **SHAPES[arch]))
    _, expected, _ = run(path, "torch_ref")
    llm, got, again = run(path, "triton_paged")
    assert type(llm.llm_engine.runner.backend).__name__ == "TritonPagedBackend"
    assert llm.llm_engine.stats().prefix_cache_hits > 0
    for e, g in zip(expected, got):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        for le, lg in zip(e.outputs[0].logprobs, g.outputs[0].logprobs):
            token = next(iter(le))
            assert abs(le[token].logprob - lg[token].logprob) < 1e-4
    assert again[0].outputs[0].token_ids == got[0].outputs[0].token_ids[:4]


def test_batch_invariance_is_honoured_on_cuda_when_asked_and_off_by_default_there():
    cuda = torch.device("cuda")
    assert resolve_batch_invariant(None, cuda) is False
    assert resolve_batch_invariant(False, cuda) is False
    assert resolve_batch_invariant(True, cuda) is True  # Triton is installed: its invariant products run
    with pytest.raises(ValueError, match="batch_invariant on mps"):
        resolve_batch_invariant(True, torch.device("mps"))
    cpu = torch.device("cpu")
    assert resolve_batch_invariant(None, cpu) is True and resolve_batch_invariant(False, cpu) is False


def test_a_batch_invariant_cuda_run_takes_the_triton_products_and_norms():
    # the choice alone (no GPU here): every product on TritonProducts (its float products the invariant
    # matmul), the Triton row norms in float32 too; a choice that would leave cuBLAS or PyTorch's attention
    # in the step is refused
    cuda = torch.device("cuda")
    triton_backend, kernels = get_attention_backend("triton_paged", torch.device("cpu"), torch.float32, True)
    for linear_kernel in ("auto", "triton"):
        choice = choose_kernels(ModelConfig(linear_kernel=linear_kernel), cuda, torch.float32, triton_backend,
                                kernels, True, False, True)
        assert isinstance(choice.native, TritonProducts) and choice.batch_invariant
        assert isinstance(choice.elementwise, TritonFusedOps)
    off = choose_kernels(ModelConfig(), cuda, torch.float32, triton_backend, kernels, False, False, True)
    # not invariant: TritonProducts still (quantised weights stay packed) but float products on cuBLAS, and
    # PyTorch's float32 ops
    assert isinstance(off.native, TritonProducts) and not off.batch_invariant and off.elementwise is None
    with pytest.raises(ValueError, match="--linear-kernel dense"):
        choose_kernels(ModelConfig(linear_kernel="dense"), cuda, torch.float32, triton_backend, kernels, True,
                       False, True)
    reference, kernels = get_attention_backend("torch_ref", torch.device("cpu"), torch.float32, True)
    with pytest.raises(ValueError, match="needs the triton_paged attention backend"):
        choose_kernels(ModelConfig(), cuda, torch.float32, reference, kernels, True, False, True)


@pytest.fixture(scope="module")
def one_layer_llama(tmp_path_factory):
    """A one-layer tiny Llama with a 256-token vocabulary (prompts given as ids): the interpreter runs every
    tile of every product in Python, the LM head's too (49,152 outputs would cost seconds a step). Weights
    drawn at 0.3 (not 0.02): peaked logits, whose logprobs keep a product's last bits (near-uniform ones,
    logprobs near -5.5, round them away and would hide a product summed in another order)."""
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("small"), arch="llama", num_hidden_layers=1,
                                  vocab_size=256, initializer_range=0.3))


def _ids_and_logprobs(output) -> tuple:
    completion = output.outputs[0]
    return tuple(completion.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in step.items()))
                                              for step in completion.logprobs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_triton_products_give_a_request_its_own_output_in_a_batch(one_layer_llama, dtype):
    # the batch-invariant CUDA path on CPU tensors (1-2 s a dtype): products on the Triton invariant matmul,
    # attention on the unified kernel. A request alone, then beside a one-token prompt (its decodes) and a
    # 23-token one whose prefill a 16-token budget chunks beside the target's steps, after the target's first
    # block is cached: ids and logprobs equal bit for bit (tests/models/test_batch_invariance.py, on Triton)
    llm = LLM(one_layer_llama, attention_backend="triton_paged", linear_kernel="triton", batch_invariant=True,
              dtype=dtype, block_size=8, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=16)
    model = llm.llm_engine.runner.model
    assert isinstance(model.layers[0].mlp.down_proj.kernel, InvariantDenseKernel)
    assert isinstance(model.logits_kernel, InvariantDenseKernel)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)
    target = {"prompt_token_ids": [17, 99, 3, 250, 41, 8, 8, 120, 77, 5]}
    alone = llm.generate([target], params, use_tqdm=False)[0]
    others = [{"prompt_token_ids": [64]}, {"prompt_token_ids": list(range(20, 43))}]
    batched = llm.generate([others[0], target, others[1]], params, use_tqdm=False)[1]
    assert _ids_and_logprobs(batched) == _ids_and_logprobs(alone)


@pytest.mark.parametrize("invariant", [True, False])
def test_decode_steps_through_padded_graph_buckets_give_the_eager_tokens(llama, invariant):
    # the graph runner's static buffers without capture (no GPU): three decode rows run in bucket 4
    # with one padding row (slot -1, context 0), which must change no output and write no block;
    # without batch invariance (CUDA's default) the graph splits every sequence's keys, short ones too.
    # The graphed engine schedules asynchronously (CUDA's default): its decode rows' ids are placeholders,
    # filled into the static buffer on the device from the previous step's samples
    path = llama
    prompts = PROMPTS[:3]
    # every prompt (45 tokens in all, the long one 34: several key tiles to split) prefills in the first step,
    # so each later step is a decode step of all three rows: 4 tokens give 3 of them
    options = {**ENGINE, "batch_invariant": invariant, "max_num_batched_tokens": 64}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    eager = LLM(path, attention_backend="triton_paged", **options)
    expected = eager.generate(prompts, params, use_tqdm=False)
    graphed = LLM(path, attention_backend="triton_paged", **options, async_scheduling=True)
    runner = graphed.llm_engine.runner
    runner.use_decode_graphs(max_num_seqs=8, max_model_len=256, capture=False)
    replays, placeholders = [], []
    original = runner.graphs.run

    def recording(batch, bucket, *rest):
        replays.append((len(batch), bucket))
        placeholders.append(sum(item.placeholder for item in batch))
        return original(batch, bucket, *rest)

    runner.graphs.run = recording
    got = graphed.generate(prompts, params, use_tqdm=False)
    assert (3, 4) in replays and all(bucket in (1, 2, 4) for _, bucket in replays)
    assert sum(placeholders) >= 6  # the decode steps after the first ran on placeholders
    for e, g in zip(expected, got):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        for le, lg in zip(e.outputs[0].logprobs, g.outputs[0].logprobs):
            token = next(iter(le))
            assert abs(le[token].logprob - lg[token].logprob) < 1e-5


class _CountingProposer:
    """Proposes the request's next three token ids after its last one (mostly rejected: verify steps of every
    length), the same in every engine."""

    def propose(self, wanted):
        from tokenmill.spec_decode.controller import Draft

        last = {r.request_id: (r.output_token_ids or r.prompt_token_ids)[-1] for r, _ in wanted}
        return {r.request_id: Draft([(last[r.request_id] + k) % 1000 for k in (1, 2, 3)][:room]) for r, room in wanted}

    def forget(self, request_id):
        pass


def test_mixed_and_verify_steps_through_padded_token_buckets_give_the_eager_tokens(llama):
    # the mixed steps' graph buffers without capture (no GPU): a 16-token budget chunks the long prompt beside
    # the others' decodes (mixed steps), and proposals make verify steps; each runs in a token bucket with one
    # padding sequence (slot -1, context 0) and empty sequence slots, which must change no output
    prompts = PROMPTS[:3]
    options = {**ENGINE, "batch_invariant": False, "speculative_method": "ngram", "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    eager = LLM(llama, attention_backend="triton_paged", **options)
    eager.llm_engine.speculation.proposer = _CountingProposer()
    expected = eager.generate(prompts, params, use_tqdm=False)
    graphed = LLM(llama, attention_backend="triton_paged", **options)
    graphed.llm_engine.speculation.proposer = _CountingProposer()
    runner = graphed.llm_engine.runner
    runner.use_decode_graphs(max_num_seqs=4, max_model_len=256, capture=False, max_num_tokens=16,
                             sizes=[1, 2, 4, 8, 12, 20])
    assert runner.mixed_graphs.sizes == [1, 2, 4, 8, 12, 20] and runner.graphs.sizes == [1, 2, 4]
    replays = []
    original = runner.mixed_graphs.run
    runner.mixed_graphs.run = lambda bucket, ids, *rest: replays.append((len(ids), bucket)) or original(bucket, ids,
                                                                                                         *rest)
    got = graphed.generate(prompts, params, use_tqdm=False)
    assert any(tokens < bucket for tokens, bucket in replays)  # padded
    steps = graphed.llm_engine.telemetry.steps
    assert {"mixed", "verify", "decode"} <= {step.kind for step in steps} and all(step.graphed for step in steps)
    for e, g in zip(expected, got):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        for le, lg in zip(e.outputs[0].logprobs, g.outputs[0].logprobs):
            token = next(iter(le))
            assert abs(le[token].logprob - lg[token].logprob) < 1e-5


def test_graph_buckets_cover_max_num_seqs_and_only_plain_decode_steps_take_them():
    from tokenmill.worker.cuda_graphs import DecodeGraphs, bucket_sizes
    from tokenmill.worker.request_state import BatchItem

    assert bucket_sizes(1) == [1]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert bucket_sizes(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.sizes = bucket_sizes(20)
    item = lambda n, spec=(): BatchItem("r", [5] * n, 10, [[0]], True, GREEDY, [1], [], list(spec))  # noqa: E731
    assert graphs.bucket_for([item(1)] * 5, lora_active=False) == 8
    assert graphs.bucket_for([item(1)] * 25, lora_active=False) is None  # past the largest bucket
    assert graphs.bucket_for([item(1), item(3)], lora_active=False) is None  # a prefill chunk
    assert graphs.bucket_for([item(2, [7])], lora_active=False) is None  # speculative proposals
    assert graphs.bucket_for([item(1)], lora_active=True) is None


def test_an_fp8_kv_cache_gives_the_reference_backends_tokens(llama):
    # the same one-byte cache on both backends (quantising itself moves the logits): the Triton writer stores
    # the reference's bytes and its kernels read them as the reference does, through a chunked prefill beside
    # a decode and a prefix-cache hit that reads the first request's one-byte blocks. fp8 only and few
    # tokens (~1 s: the interpreter runs every program in Python): int8 differs in the rounding and the
    # widening alone, which tests/kernels/test_triton_kv_rows.py checks for both formats
    prompts, params = [PROMPTS[2], PROMPTS[1]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1)
    outputs = {}
    for backend in ("torch_ref", "triton_paged"):
        llm = LLM(llama, attention_backend=backend, kv_cache_dtype="fp8", **ENGINE)
        outputs[backend] = llm.generate(prompts, params, use_tqdm=False) + llm.generate(prompts[:1], params,
                                                                                         use_tqdm=False)
    assert llm.llm_engine.runner.kv_caches[0].dtype == torch.uint8  # e4m3 bits
    assert llm.llm_engine.stats().prefix_cache_hits > 0
    for e, g in zip(outputs["torch_ref"], outputs["triton_paged"]):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        for le, lg in zip(e.outputs[0].logprobs, g.outputs[0].logprobs):
            token = next(iter(le))
            assert abs(le[token].logprob - lg[token].logprob) < 1e-4
