"""A request's output does not depend on what else the engine is doing (issue 19).

On the real default model in its default configuration (the GGUF's Q4_1 weights kept packed, the
default dtype of this CPU), with its weights as float32 floats, and on tiny GPTQ and compressed-tensors
checkpoints served by default, hypothesis draws the other requests of the batch and where the request sits
among them, the chunked-prefill budget, the prefix cache's state (off, cold, warm, a partial hit),
preemption (a KV cache too small for the batch, reloading from the second tier), n-gram speculation and
the sampling (greedy or seeded); the request's token ids and logprobs must equal, bit for bit, those of
the same request run alone.

Example counts are CI-sized; TOKENMILL_RELIABILITY_SCALE (default 1) multiplies them and restores the larger
batches for a full-size run.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st

from tokenmill import SamplingParams

# held-out prompts: none of them is used to tune anything
TARGETS = ["The capital of France is", "Write a haiku about rain on a tin roof.",
           "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n", "Three facts about octopuses:\n1.",
           "Q: What is 17 times 23?\nA:", "The quick brown fox jumps over the lazy dog. The quick brown fox",
           "In 1969, the first people to walk on the Moon", "Translate to French: 'Where is the library?'"]
OTHERS = ["Hi", "Tell me a story about a robot who learns to paint, in the style of a fairy tale.",
          "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20", "Summarise: " + "the cat sat on the mat. " * 12,
          "Why is the sky blue?", "import numpy as np\n\ndef softmax(x):", "List the planets of the solar system.",
          "A" * 40]
MAX_TOKENS = 12
BLOCK_SIZE = 16
SCALE = int(os.environ.get("TOKENMILL_RELIABILITY_SCALE", "1"))
# batches of up to 8 requests: enough to overflow the 12-block KV cache of the preemption case
MAX_OTHERS = 7 if SCALE == 1 else 14
# the long prompt's length: 512 tokens at CI size (after a 256-token hit its other 244 prompt tokens take 4 steps of
# the 100-token budget beside the other prompt's 74 and then its decodes, chunks that end inside blocks, across 15
# block boundaries, at contexts past the AMX prefill tiles' first 256-key block; elsewhere the invariant attention
# runs every query as a one-query decode at its position, alike at any context: the 1,024 tokens before proved no
# more, in 4.5 s more), the full 2,048 of the default budget in a full-size run (a minute more on an AVX2 machine,
# whose default dtype float32 makes the quadratic attention the cost)
LONG = 512 if SCALE == 1 else 2048


def examples(count: int) -> int:
    """`count` Hypothesis examples, times TOKENMILL_RELIABILITY_SCALE."""
    return count * SCALE


# Hypothesis's first draw (derandomised: the same every run) is its simplest scenario, the target alone: greedy,
# nothing else running, nothing cached, no preemption or speculation. The default configuration's test runs it;
# the tests that only change the weights' format or dtype would repeat it at the cost of two more engines, so
# at scale 1 they run their explicit examples alone and draw only in a full-size run.
EXPLICIT_AT_SCALE_1 = dict(phases=[Phase.explicit]) if SCALE == 1 else {}


def sampling(kind: str, seed: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    return SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True,
                          logprobs=2)


def result(output) -> tuple:
    """The request's token ids and, per token, its logprob and the top-2 logprobs, exactly."""
    completion = output.outputs[0]
    logprobs = tuple(tuple(sorted((t, lp.logprob) for t, lp in step.items())) for step in completion.logprobs)
    return tuple(completion.token_ids), logprobs


class Engines:
    """One engine at a time, rebuilt when the drawn configuration changes (loading takes about a second);
    `weights`: engine options every engine of the test shares (the weight format and dtype)."""

    def __init__(self, make, **weights):
        self.make, self.weights, self.key, self.llm = make, weights, None, None
        self.alone: dict = {}
        self.alone_engines: dict = {}

    def get(self, **options):
        key = tuple(sorted(options.items()))
        if key != self.key:
            self.llm = None
            self.llm, self.key = self.make(max_model_len=512, block_size=BLOCK_SIZE, **self.weights, **options), key
        return self.llm

    def result_alone(self, target: int, kind: str, speculation: str, targets=TARGETS) -> tuple:
        """The target's result run alone, per sampling kind and speculation (greedy output must not depend on
        speculation; seeded sampling with it is compared with itself alone)."""
        key = (id(targets), target, kind, speculation if kind == "seeded" else "none")
        if key not in self.alone:
            llm = self.alone_engine(key[3])
            self.alone[key] = result(llm.generate([targets[target]], sampling(kind, 1000 + target), use_tqdm=False)[0])
        return self.alone[key]

    def alone_engine(self, speculation: str):
        """The engine that runs requests alone, one per speculation setting, built on first use. It serves one
        request at a time and has no prefix cache, so no request it ran before feeds the next one anything;
        state that leaked between its requests anyway would show as a mismatch, not hide one."""
        if speculation not in self.alone_engines:
            options = {} if speculation == "none" else dict(speculative_method=speculation, num_speculative_tokens=3)
            self.alone_engines[speculation] = self.make(max_model_len=512, block_size=BLOCK_SIZE, prefix_caching=False,
                                                        num_kv_blocks=64, **self.weights, **options)
        return self.alone_engines[speculation]


@pytest.fixture(scope="module")
def engines(make_smollm2):
    """The default configuration: the GGUF's quantised weights kept packed, this CPU's default dtype."""
    return Engines(make_smollm2)


@pytest.fixture(scope="module")
def float_engines(make_smollm2):
    """Float weights (every weight dequantised) in float32: the batch-invariant float product. (Where the
    CPU has native bfloat16, the default test above runs in bfloat16.)"""
    return Engines(make_smollm2, quantization="none", dtype="float32")


@st.composite
def scenarios(draw):
    others = draw(st.lists(st.integers(0, len(OTHERS) - 1), max_size=MAX_OTHERS))
    return dict(target=draw(st.integers(0, len(TARGETS) - 1)), kind=draw(st.sampled_from(["greedy", "seeded"])),
                others=others, position=draw(st.integers(0, len(others))),
                budget=draw(st.sampled_from([2048, 64, 16, 5])),
                cache=draw(st.sampled_from(["off", "cold", "warm", "partial"])),
                preempt=draw(st.booleans()), speculation=draw(st.sampled_from(["none", "ngram"])))


def check(engines: Engines, s: dict, targets=TARGETS, others=OTHERS) -> None:
    options = dict(max_num_batched_tokens=s["budget"], prefix_caching=s["cache"] != "off")
    if s["preempt"]:  # 12 blocks of 16 tokens: a few requests at a time, the rest preempted and recomputed
        options.update(num_kv_blocks=12, secondary_kv_gb=0.01)
    if s["speculation"] != "none":
        options.update(speculative_method=s["speculation"], num_speculative_tokens=3)
    llm = engines.get(**options)
    index = s["target"] % len(targets)
    target = targets[index]
    if s["cache"] == "warm":
        llm.generate([target], sampling("greedy", 0), use_tqdm=False)
    elif s["cache"] == "partial":
        llm.generate([partly(target)], sampling("greedy", 0), use_tqdm=False)
    prompts = [others[i % len(others)] for i in s["others"]]
    params = [sampling("greedy" if i % 2 else "seeded", i) for i in range(len(prompts))]
    prompts.insert(s["position"], target)
    params.insert(s["position"], sampling(s["kind"], 1000 + index))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert result(outputs[s["position"]]) == engines.result_alone(index, s["kind"], s["speculation"], targets)


# Scenarios that between them take every value of every drawn dimension, so that the default configuration's
# test does not depend on what a few drawn examples happen to reach. Every test runs the first: a seeded request
# among 4 others that need 17 of the 12 KV blocks, 16-token chunks, a partial prefix hit and speculation.
COVERING = [dict(target=6, kind="seeded", others=[3, 2, 1, 5], position=2, budget=16, cache="partial",
                 preempt=True, speculation="ngram"),
            dict(target=2, kind="greedy", others=[7, 0], position=1, budget=5, cache="warm", preempt=False,
                 speculation="none"),
            dict(target=1, kind="greedy", others=[0, 1, 2, 3, 4, 5, 6], position=0, budget=64, cache="cold",
                 preempt=True, speculation="none"),
            dict(target=4, kind="seeded", others=[7], position=1, budget=2048, cache="off", preempt=False,
                 speculation="ngram")]


def partly(prompt):
    """A prompt that shares the first half of `prompt` (for an image prompt: its text up to and with its
    first image) and then goes its own way."""
    if isinstance(prompt, str):
        return prompt[:len(prompt) // 2] + " and so on"
    return {"prompt": prompt["prompt"].split("\n", 1)[0] + "\nand so on", "multi_modal_data":
            {"image": prompt["multi_modal_data"]["image"][:1]}}


@pytest.mark.slow
@settings(max_examples=examples(3), deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
@example(scenario=COVERING[0])
@example(scenario=COVERING[1])
@example(scenario=COVERING[2])
@example(scenario=COVERING[3])
def test_output_does_not_depend_on_what_else_runs(engines, scenario):
    check(engines, scenario)


@pytest.mark.slow
@settings(max_examples=examples(1), deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow],
          **EXPLICIT_AT_SCALE_1)
@given(scenario=scenarios())
@example(scenario=COVERING[0])
def test_output_with_float_weights_does_not_depend_on_what_else_runs(float_engines, scenario):
    check(float_engines, scenario)


@pytest.fixture(scope="module")
def bfloat16_engines(make_smollm2):
    """Float weights in bfloat16 (every weight dequantised): on AMX the tiles at every row count, elsewhere
    the invariant float product."""
    return Engines(make_smollm2, quantization="none", dtype="bfloat16")


@pytest.mark.slow
@settings(max_examples=examples(1), deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow],
          **EXPLICIT_AT_SCALE_1)
@given(scenario=scenarios())
@example(scenario=COVERING[0])
def test_output_with_bfloat16_weights_does_not_depend_on_what_else_runs(bfloat16_engines, scenario):
    check(bfloat16_engines, scenario)


@pytest.fixture(scope="module")
def packed_checkpoint_engines(tmp_path_factory):
    """Tiny checkpoints in the formats people download, served by default (int4 kept packed): GPTQ (4 bits,
    groups of 32) and compressed-tensors (W4A16, as its own library writes it)."""
    from helpers.packed_checkpoints import write_compressed, write_pair
    from helpers.tiny_models import make_tiny_hf_model
    from tokenmill import LLM

    folder = tmp_path_factory.mktemp("packed")
    base = make_tiny_hf_model(folder / "base", arch="llama")
    gptq, _ = write_pair(base, folder / "gptq", "gptq", 4)
    write_compressed(base, folder / "ct", "W4A16")
    return {name: Engines(lambda **options: LLM(str(path), **options))
            for name, path in (("gptq", gptq), ("compressed-tensors", folder / "ct"))}


@pytest.mark.parametrize("checkpoint", ["gptq", "compressed-tensors"])
@settings(max_examples=examples(1), deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow],
          **EXPLICIT_AT_SCALE_1)
@given(scenario=scenarios())
@example(scenario=COVERING[0])
def test_output_of_a_packed_checkpoint_does_not_depend_on_what_else_runs(packed_checkpoint_engines, checkpoint,
                                                                         scenario):
    check(packed_checkpoint_engines[checkpoint], scenario)


def long_prompt_ids(llm, length: int) -> list[int]:
    """`length` token ids of the shipped passages, from the model's own tokenizer."""
    from tokenmill.bench.datasets import quote_passages
    ids = llm.get_tokenizer().encode(" ".join(quote_passages()))
    return (ids * (length // len(ids) + 1))[:length]


@pytest.fixture(scope="module")
def long_prompt_alone(make_smollm2):
    """A prompt of LONG - MAX_TOKENS tokens and its result run alone on the default configuration, the whole
    prompt in one step (the same for every drawn example, so run once)."""
    alone = make_smollm2(max_model_len=LONG + 52, max_num_batched_tokens=LONG)
    prompt = long_prompt_ids(alone, LONG - MAX_TOKENS)
    return prompt, result(alone.generate([{"prompt_token_ids": prompt}], sampling("greedy", 0), use_tqdm=False)[0])


# At scale 1 the explicit example alone: the first draw (budget 16, no cache: 128 prefill chunks) proves what
# its 100-token chunks after a partial hit prove, at several times its steps.
@pytest.mark.slow
@settings(max_examples=examples(1), deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow],
          **EXPLICIT_AT_SCALE_1)
@given(budget=st.integers(16, LONG // 2), other=st.integers(1, LONG // 7), cache=st.booleans())
@example(budget=100, other=37, cache=True)  # a partial hit, then chunks that end off the blocks' boundaries
def test_a_long_prompt_gives_its_own_result_however_it_is_chunked(make_smollm2, long_prompt_alone, budget, other,
                                                                   cache):
    """A long prompt (LONG tokens) on the default configuration, its prefill cut into chunks of a drawn budget
    and sharing steps with another prompt of a drawn length: ids and logprobs equal those of the prompt
    run alone with the whole prompt in one step."""
    prompt, expected = long_prompt_alone
    params = sampling("greedy", 0)
    llm = make_smollm2(max_model_len=LONG + 52, max_num_batched_tokens=budget, prefix_caching=cache)
    if cache:  # a partial hit: the first half of the prompt is cached by an earlier request
        llm.generate([{"prompt_token_ids": prompt[:LONG // 2]}], sampling("greedy", 0), use_tqdm=False)
    outputs = llm.generate([{"prompt_token_ids": prompt[other:other + 2 * other]}, {"prompt_token_ids": prompt}],
                           [sampling("seeded", 3), params], use_tqdm=False)
    assert result(outputs[1]) == expected


def _image(seed: int, width: int, height: int):
    import numpy as np
    from PIL import Image
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def image_prompts(marker: str) -> tuple[list, list]:
    """(targets, others) of prompts with images, written with the model's placeholder token `marker`."""
    targets = [{"prompt": "USER: " + f"{marker}\n" * count + question + " ASSISTANT:",
                "multi_modal_data": {"image": [_image(seed + k, 30 + 7 * k, 45 - 5 * k) for k in range(count)]}}
               for seed, count, question in ((1, 1, "What is this?"), (2, 2, "Compare them."),
                                             (3, 1, "Describe it in detail."), (4, 2, "Which is brighter?"))]
    others = ["USER: Hi ASSISTANT:", "USER: Tell me about the sea. ASSISTANT:", *targets[::-1],
              {"prompt": f"USER: {marker}\nAnd this one? ASSISTANT:", "multi_modal_data": {"image": [_image(9, 64, 64)]}}]
    return targets, others


@pytest.fixture(scope="module", params=["llava", "qwen2-vl"])
def image_engines(request, tmp_path_factory):
    """A tiny LLaVA (CLIP tower: 16 positions per image) or Qwen2-VL (positions by the image's size, M-RoPE)
    served by default: this CPU's default dtype; with its prompts."""
    from helpers.tiny_models import make_tiny_llava, make_tiny_qwen2_vl
    from tokenmill import LLM

    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "llava":
        folder, marker = make_tiny_llava(folder, "clip"), "<image>"
    else:
        folder, marker = make_tiny_qwen2_vl(folder), "<|image_pad|>"
    return Engines(lambda **options: LLM(str(folder), **options)), image_prompts(marker)


@settings(max_examples=examples(1), deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
@example(scenario=COVERING[0])
def test_output_with_images_does_not_depend_on_what_else_runs(image_engines, scenario):
    """Prompts with images among prompts with and without them: chunks that split an image (budget 5 and 16),
    the same image's blocks cached by another request, preemption, speculation."""
    # a draw with nothing else running and nothing cached (Hypothesis's first) has no other request to depend on
    assume(scenario["others"] or scenario["cache"] in ("warm", "partial"))
    engines, (targets, others) = image_engines
    check(engines, scenario, targets, others)
