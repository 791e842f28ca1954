"""Vision-language models against HF transformers (issue 44): tiny random LLaVA checkpoints (a CLIP tower with its
class token dropped, and a SigLIP tower with every patch kept), written by transformers itself with the
processor of the llava-hf layout. Greedy ids and logprobs equal `generate` of LlavaForConditionalGeneration in
float32 on the processor's own outputs, for prompts of 1-3 images of different sizes batched with text-only
prompts, with chunks smaller than an image and after prefix-cache hits; an image that differs in one pixel
never reuses another image's blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from helpers.tiny_models import make_tiny_llava
from tokenmill import LLM, SamplingParams

MAX_TOKENS = 32
IMAGE_TOKENS = 16  # both tiny towers: 16 patches of 8x8 in a 32x32 image
QUESTIONS = ["What is this?", "Describe the picture.", "Which one is brighter?", "Count the shapes.",
             "What colour dominates?", "Is there a face?", "Compare them.", "Tell me a story about it."]
TEXT_ONLY = ["USER: Hello there ASSISTANT:", "USER: Write a poem about the sea ASSISTANT:"]


def random_image(seed: int, width: int, height: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def image_prompts() -> list[tuple[str, list[Image.Image]]]:
    """8 prompts of 1-3 images each, every image of its own size (landscape, portrait, square, tiny, large)."""
    sizes = [(40, 50), (64, 32), (32, 32), (17, 90), (120, 80), (9, 9), (50, 41), (33, 70)]
    prompts = []
    for index, question in enumerate(QUESTIONS):
        count = 1 + index % 3
        images = [random_image(10 * index + k, *sizes[(index + k) % len(sizes)]) for k in range(count)]
        prompts.append(("USER: " + "<image>\n" * count + question + " ASSISTANT:", images))
    return prompts


def greedy(logprobs: int = 0) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)


def chosen(output) -> tuple[list[int], list[float]]:
    completion = output.outputs[0]
    return list(completion.token_ids), [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]


@pytest.fixture(scope="module", params=["clip", "siglip"])
def tiny_llava(request, tmp_path_factory):
    """(folder, the HF oracle's (prompt ids, greedy ids, their logprobs) per image prompt)."""
    from transformers import LlavaForConditionalGeneration, LlavaProcessor

    folder = make_tiny_llava(tmp_path_factory.mktemp(f"llava_{request.param}"), request.param)
    processor = LlavaProcessor.from_pretrained(folder)
    model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    expected = []
    for text, images in image_prompts():
        inputs = processor(text=text, images=images, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
        ids = out.sequences[0, inputs.input_ids.shape[1]:].tolist()
        logprobs = [torch.log_softmax(score[0].float(), -1)[t].item() for score, t in zip(out.scores, ids)]
        expected.append((inputs.input_ids[0].tolist(), ids, logprobs))
    return folder, expected


def assert_matches_hf(outputs, expected) -> None:
    for output, (prompt_ids, ids, logprobs) in zip(outputs, expected):
        assert output.prompt_token_ids == prompt_ids  # each image's placeholder expanded as the HF processor does
        got_ids, got_logprobs = chosen(output)
        assert got_ids == ids
        assert np.allclose(got_logprobs, logprobs, rtol=0, atol=1e-4)


def test_greedy_output_equals_hf_batched_with_text_chunked_and_after_a_prefix_hit(tiny_llava):
    folder, expected = tiny_llava
    # chunks of 8 tokens: every image's 16 placeholders are split over chunks (and shared with other requests)
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=8, max_num_encoder_input_tokens=16,
              block_size=16, max_model_len=256)
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in image_prompts()]
    mixed = prompts[:4] + TEXT_ONLY + prompts[4:]
    params = [greedy()] * len(mixed)
    outputs = llm.generate(mixed, params, use_tqdm=False)
    assert_matches_hf(outputs[:4] + outputs[6:], expected)
    again = llm.generate(prompts, [greedy()] * len(prompts), use_tqdm=False)
    assert all(output.metrics.num_cached_tokens >= 16 for output in again)  # the images' blocks came from the cache
    assert_matches_hf(again, expected)
    text_alone = LLM(str(folder), dtype="float32", max_model_len=256).generate(TEXT_ONLY, [greedy()] * 2,
                                                                                 use_tqdm=False)
    assert [chosen(o) for o in outputs[4:6]] == [chosen(o) for o in text_alone]


def test_an_image_one_pixel_apart_never_reads_another_images_blocks(tiny_llava):
    folder, _ = tiny_llava
    llm = LLM(str(folder), dtype="float32", block_size=4, max_model_len=256)
    first = random_image(1, 40, 50)
    changed = first.copy()
    changed.putpixel((13, 21), tuple((v + 1) % 256 for v in changed.getpixel((13, 21))))
    text = "USER: <image>\nWhat is this? ASSISTANT:"
    prefix = len(llm.get_tokenizer()("USER: ").input_ids)  # the tokens before the image's placeholders

    def run(image):
        return llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, greedy(1), use_tqdm=False)[0]

    original = run(first)
    same = run(first.copy())
    assert same.metrics.num_cached_tokens >= prefix + IMAGE_TOKENS and chosen(same) == chosen(original)
    other = run(changed)
    assert other.metrics.num_cached_tokens <= prefix  # only the blocks before the image
    fresh = LLM(str(folder), dtype="float32", block_size=4, max_model_len=256)
    alone = fresh.generate({"prompt": text, "multi_modal_data": {"image": changed}}, greedy(1), use_tqdm=False)[0]
    assert chosen(other) == chosen(alone) and chosen(other) != chosen(original)


def test_prompts_and_images_must_pair_up(tiny_llava):
    folder, _ = tiny_llava
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    image = random_image(0, 8, 8)
    with pytest.raises(ValueError, match=r"2 image placeholder\(s\) .* but 1 image\(s\)"):
        llm.generate({"prompt": "USER: <image><image> hi", "multi_modal_data": {"image": image}}, use_tqdm=False)
    with pytest.raises(ValueError, match="placeholders .* but no image came with it"):
        llm.generate("USER: <image> hi", use_tqdm=False)
    with pytest.raises(ValueError, match="multi_modal_data takes"):
        llm.generate({"prompt": "USER: <image> hi", "multi_modal_data": {"video": image}}, use_tqdm=False)
    with pytest.raises(ValueError, match="must be a PIL.Image.Image"):
        llm.generate({"prompt": "USER: <image> hi", "multi_modal_data": {"image": b"png"}}, use_tqdm=False)
    # the engine goes on serving
    ok = llm.generate({"prompt": "USER: <image> hi", "multi_modal_data": {"image": image}}, greedy(), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == MAX_TOKENS


def test_a_text_only_model_refuses_images(tmp_path):
    from helpers.tiny_models import make_tiny_hf_model

    llm = LLM(str(make_tiny_hf_model(tmp_path / "text")), max_model_len=128)
    with pytest.raises(ValueError, match="text-only: it takes no images"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": random_image(0, 4, 4)}}, use_tqdm=False)
