"""Vision-language models against HF transformers (issue 44), two families that lay images into the sequence
differently: tiny random LLaVA checkpoints (a CLIP tower with its class token dropped, and a SigLIP tower with
every patch kept: 16 positions per image) written by transformers with the processor of the llava-hf layout,
and tiny random Qwen2-VL and Qwen2.5-VL (dynamic resolution: 1-16 positions by the image's size, multimodal
RoPE; Qwen2.5-VL's windowed attention) with Qwen2-VL's image processor. Greedy ids and logprobs equal `generate` of the HF model in float32 on the
processor's own outputs, for prompts of 1-3 images of different sizes batched with text-only prompts, with
chunks smaller than an image and after prefix-cache hits; an image that differs in one pixel never reuses
another image's blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from helpers.tiny_models import make_tiny_llava, make_tiny_qwen2_vl
from tokenmill import LLM, SamplingParams

# 8 tokens: every image is read at prefill, and each decode step after it (Qwen2-VL's positions shifted by the
# images' grids included) is the same step; more tokens only repeat it
MAX_TOKENS = 8
QUESTIONS = ["What is this?", "Describe the picture.", "Which one is brighter?", "Count the shapes.",
             "What colour dominates?", "Is there a face?", "Compare them.", "Tell me a story about it."]
TEXT_ONLY = ["USER: Hello there ASSISTANT:", "USER: Write a poem about the sea ASSISTANT:"]


def random_image(seed: int, width: int, height: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


SIZES = [(40, 50), (64, 32), (32, 32), (17, 90), (120, 80), (9, 9), (50, 41), (33, 70)]


def conversations() -> list[tuple[list[dict], list[Image.Image]]]:
    """8 user turns of 1-3 images each, every image of its own size (landscape, portrait, square, tiny, large)."""
    turns = []
    for index, question in enumerate(QUESTIONS):
        count = 1 + index % 3
        images = [random_image(10 * index + k, *SIZES[(index + k) % len(SIZES)]) for k in range(count)]
        content = [{"type": "image"}] * count + [{"type": "text", "text": question}]
        turns.append(([{"role": "user", "content": content}], images))
    return turns


def image_prompts(folder) -> list[tuple[str, list[Image.Image]]]:
    """The conversations as the model's own chat template writes them, with their images."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return [(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), images)
            for messages, images in conversations()]


def placeholder(folder) -> str:
    """The text of the model's image placeholder token."""
    import json

    from transformers import AutoTokenizer

    config = json.loads((folder / "config.json").read_text())
    token = config.get("image_token_id", config.get("image_token_index"))
    return AutoTokenizer.from_pretrained(folder).convert_ids_to_tokens(token)


def greedy(logprobs: int = 0) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)


def chosen(output) -> tuple[list[int], list[float]]:
    completion = output.outputs[0]
    return list(completion.token_ids), [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]


@pytest.fixture(scope="module", params=["llava-clip", "llava-siglip", "qwen2-vl", "qwen2.5-vl"])
def tiny_vlm(request, tmp_path_factory):
    """(folder, the HF oracle's (prompt ids, greedy ids, their logprobs) per image prompt)."""
    folder = tmp_path_factory.mktemp(request.param)
    if request.param.startswith("qwen"):
        folder = make_tiny_qwen2_vl(folder, version="2.5" if request.param == "qwen2.5-vl" else "2")
        oracle = qwen2_vl_oracle(folder)
    else:
        folder = make_tiny_llava(folder, request.param.split("-")[1])
        oracle = llava_oracle(folder)
    expected = []
    for text, images in image_prompts(folder):
        model, inputs = oracle(text, images)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
        ids = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        logprobs = [torch.log_softmax(score[0].float(), -1)[t].item() for score, t in zip(out.scores, ids)]
        expected.append((inputs["input_ids"][0].tolist(), ids, logprobs))
    return folder, expected


def llava_oracle(folder):
    """HF's LLaVA and its own processor's inputs for (prompt text, images)."""
    from transformers import LlavaForConditionalGeneration, LlavaProcessor

    processor = LlavaProcessor.from_pretrained(folder)
    model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return lambda text, images: (model, dict(processor(text=text, images=images, return_tensors="pt")))


def qwen2_vl_oracle(folder):
    """HF's Qwen2-VL (or Qwen2.5-VL) and the inputs Qwen2VLProcessor makes (it cannot be built without
    torchvision's video processor, so its steps are done here as it does them): Qwen2-VL's image processor, and
    each <|image_pad|> repeated grid t*h*w / 4 times."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    tokenizer, processor = AutoTokenizer.from_pretrained(folder), AutoImageProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def inputs(text, images):
        pixels = processor(images=images, return_tensors="pt")
        counts = iter(int(grid.prod()) // 4 for grid in pixels["image_grid_thw"])
        ids = []
        for token in tokenizer(text).input_ids:
            ids += [pad] * next(counts) if token == pad else [token]
        input_ids = torch.tensor([ids])
        return model, {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                       "pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"],
                       "mm_token_type_ids": (input_ids == pad).int()}
    return inputs


@pytest.fixture(scope="module")
def plain_llm(tiny_vlm):
    """The family's model in float32 with the engine's defaults, for the tests that need no particular chunking,
    block size or empty cache."""
    folder, _ = tiny_vlm
    return LLM(str(folder), dtype="float32", max_model_len=256)


def assert_matches_hf(outputs, expected) -> None:
    for output, (prompt_ids, ids, logprobs) in zip(outputs, expected):
        assert output.prompt_token_ids == prompt_ids  # each image's placeholder expanded as the HF processor does
        got_ids, got_logprobs = chosen(output)
        assert got_ids == ids
        assert np.allclose(got_logprobs, logprobs, rtol=0, atol=1e-4)


def test_greedy_output_equals_hf_batched_with_text_chunked_and_after_a_prefix_hit(tiny_vlm, plain_llm):
    folder, expected = tiny_vlm
    # chunks of 8 tokens: every image's 16 placeholders are split over chunks (and shared with other requests)
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=8, max_num_encoder_input_tokens=16,
              block_size=16, max_model_len=256)
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in image_prompts(folder)]
    mixed = prompts[:4] + TEXT_ONLY + prompts[4:]
    params = [greedy()] * len(mixed)
    outputs = llm.generate(mixed, params, use_tqdm=False)
    assert_matches_hf(outputs[:4] + outputs[6:], expected)
    again = llm.generate(prompts, [greedy()] * len(prompts), use_tqdm=False)
    # every full block before the last token came from the cache, the images' blocks included
    assert [o.metrics.num_cached_tokens for o in again] == [(len(o.prompt_token_ids) - 1) // 16 * 16 for o in again]
    assert_matches_hf(again, expected)
    text_alone = plain_llm.generate(TEXT_ONLY, [greedy()] * 2, use_tqdm=False)
    assert [chosen(o) for o in outputs[4:6]] == [chosen(o) for o in text_alone]


def test_an_image_one_pixel_apart_never_reads_another_images_blocks(tiny_vlm):
    folder, _ = tiny_vlm
    llm = LLM(str(folder), dtype="float32", block_size=4, max_model_len=256)
    first = random_image(1, 40, 50)
    changed = first.copy()
    changed.putpixel((13, 21), tuple((v + 1) % 256 for v in changed.getpixel((13, 21))))
    marker = placeholder(folder)
    text = f"USER: {marker}\nWhat is this? ASSISTANT:"
    prefix = len(llm.get_tokenizer()("USER: ").input_ids)  # the tokens before the image's placeholders

    def run(image):
        return llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, greedy(1), use_tqdm=False)[0]

    original = run(first)
    positions = original.prompt_token_ids.count(llm.get_tokenizer().convert_tokens_to_ids(marker))
    same = run(first.copy())
    assert same.metrics.num_cached_tokens >= prefix + positions and chosen(same) == chosen(original)
    other = run(changed)
    assert other.metrics.num_cached_tokens <= prefix  # only the blocks before the image
    fresh = LLM(str(folder), dtype="float32", block_size=4, max_model_len=256)
    alone = fresh.generate({"prompt": text, "multi_modal_data": {"image": changed}}, greedy(1), use_tqdm=False)[0]
    assert chosen(other) == chosen(alone) and chosen(other) != chosen(original)


def test_prompts_and_images_must_pair_up(tiny_vlm, plain_llm):
    folder, _ = tiny_vlm
    llm = plain_llm
    image, marker = random_image(0, 8, 8), placeholder(folder)
    with pytest.raises(ValueError, match=r"2 image placeholder\(s\) .* but 1 image\(s\)"):
        llm.generate({"prompt": f"USER: {marker}{marker} hi", "multi_modal_data": {"image": image}}, use_tqdm=False)
    with pytest.raises(ValueError, match="placeholders .* but no image came with it"):
        llm.generate(f"USER: {marker} hi", use_tqdm=False)
    with pytest.raises(ValueError, match="multi_modal_data takes"):
        llm.generate({"prompt": f"USER: {marker} hi", "multi_modal_data": {"video": image}}, use_tqdm=False)
    with pytest.raises(ValueError, match="must be a PIL.Image.Image"):
        llm.generate({"prompt": f"USER: {marker} hi", "multi_modal_data": {"image": b"png"}}, use_tqdm=False)
    # the engine goes on serving
    ok = llm.generate({"prompt": f"USER: {marker} hi", "multi_modal_data": {"image": image}}, greedy(), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == MAX_TOKENS


def test_a_text_only_model_refuses_images(tmp_path):
    from helpers.tiny_models import make_tiny_hf_model

    llm = LLM(str(make_tiny_hf_model(tmp_path / "text")), max_model_len=128)
    with pytest.raises(ValueError, match="text-only: it takes no images"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": random_image(0, 4, 4)}}, use_tqdm=False)


@pytest.mark.parametrize("family", ["llava-1.5", "qwen2-vl"])
def test_real_processor_configs_give_hfs_output(tmp_path, family):
    """Real models' own image processor configs (llava-1.5-7b-hf: 336x336, 576 positions per image; Qwen2-VL-2B:
    up to 12.8M pixels, a 640x480 photo is 391 positions) over tiny towers of the matching geometry: the same
    prompt ids and greedy output as HF, with chunks of 64 tokens."""
    if family == "qwen2-vl":
        folder = make_tiny_qwen2_vl(tmp_path / "model", real_processor=True)
        oracle = qwen2_vl_oracle(folder)
    else:
        folder = make_tiny_llava(tmp_path / "model", "clip", real_processor=True)
        oracle = llava_oracle(folder)
    images = [random_image(5, 640, 480), random_image(6, 200, 300)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What differs?"},
                                             {"type": "image"}]}]
    from transformers import AutoTokenizer
    text = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    model, inputs = oracle(text, images)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    ids = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [torch.log_softmax(score[0].float(), -1)[t].item() for score, t in zip(out.scores, ids)]
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=64, max_model_len=2048)
    output = llm.generate({"prompt": text, "multi_modal_data": {"image": images}},
                          SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0), use_tqdm=False)[0]
    assert output.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert len(output.prompt_token_ids) > (2 * 576 if family == "llava-1.5" else 391)
    got_ids, got_logprobs = chosen(output)
    assert got_ids == ids and np.allclose(got_logprobs, logprobs, rtol=0, atol=1e-4)


def test_llm_chat_takes_image_parts_as_vllm_does(tmp_path):
    import base64
    import io

    folder = make_tiny_qwen2_vl(tmp_path / "model")
    llm = LLM(str(folder), dtype="float32", max_model_len=512)
    image = random_image(2, 60, 40)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    params = SamplingParams(temperature=0, max_tokens=6)
    by_url = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                    {"type": "text", "text": "What is this?"}]}], params,
                      use_tqdm=False)[0]
    by_pil = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                    {"type": "text", "text": "What is this?"}]}], params,
                      use_tqdm=False)[0]
    text = llm.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                 {"type": "text", "text": "What is this?"}]}])
    direct = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, params, use_tqdm=False)[0]
    assert by_url.outputs[0].token_ids == by_pil.outputs[0].token_ids == direct.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: .*file://"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}],
                 params, use_tqdm=False)


def test_an_image_the_encoder_fails_on_ends_its_request_only(tmp_path, monkeypatch):
    from tokenmill.worker.encoder_cache import EncoderCache

    folder = make_tiny_llava(tmp_path / "model", "clip")
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    broken, fine = random_image(1, 40, 40), random_image(2, 50, 30)
    prompt = "USER: <image>\nWhat is this? ASSISTANT:"
    alone = llm.generate({"prompt": prompt, "multi_modal_data": {"image": fine}}, greedy(1), use_tqdm=False)[0]
    encode = EncoderCache.embeddings
    from tokenmill.multimodal.media import image_input
    target = image_input(broken).content_hash

    def failing(self, image):
        if image.content_hash == target:
            raise RuntimeError("the encoder ran out of memory")
        return encode(self, image)

    monkeypatch.setattr(EncoderCache, "embeddings", failing)
    outputs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": fine}},
                            {"prompt": prompt, "multi_modal_data": {"image": broken}},
                            "USER: Hello ASSISTANT:"], greedy(1), use_tqdm=False)
    assert outputs[1].outputs[0].finish_reason == "error" and "ran out of memory" in outputs[1].error
    assert chosen(outputs[0]) == chosen(alone)
    assert len(outputs[2].outputs[0].token_ids) == MAX_TOKENS


def test_real_models_configs_as_transformers_4_saved_them(tmp_path):
    """llava-1.5-7b-hf's config.json (a text_config of a few fields, the rest Llama's defaults) and Qwen2-VL-2B's
    (the decoder's settings at the top level, rope_scaling of type mrope) read as transformers reads them."""
    from pathlib import Path

    from tokenmill.models.loader.hf_config import arch_config_from_hf

    configs = Path(__file__).resolve().parents[1] / "data" / "vlm_configs"
    for name in ("llava-1.5-7b-hf", "qwen2-vl-2b-instruct"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text((configs / f"{name}.json").read_text())
    llava = arch_config_from_hf(tmp_path / "llava-1.5-7b-hf")
    assert (llava.architecture, llava.hidden_size, llava.num_hidden_layers, llava.vocab_size) == \
        ("LlamaForCausalLM", 4096, 32, 32064)
    assert llava.vision.image_token_id == 32000 and llava.vision.num_image_tokens == 576
    assert llava.vision.layers_needed == 23  # features of the second-to-last of 24 layers
    qwen = arch_config_from_hf(tmp_path / "qwen2-vl-2b-instruct")
    assert (qwen.architecture, qwen.hidden_size, qwen.num_hidden_layers, qwen.tie_word_embeddings) == \
        ("Qwen2ForCausalLM", 1536, 28, True)
    assert qwen.mrope_section == (16, 24, 24) and qwen.attention_bias and qwen.eos_token_ids == (151645,)
    assert (qwen.vision.embed_dim, qwen.vision.depth, qwen.vision.image_token_id) == (1280, 32, 151655)


def test_a_chat_template_kept_by_the_processor_is_found(tmp_path):
    """llava-hf's folders keep the chat template in the processor's chat_template.json only."""
    import json

    from helpers.tiny_models import LLAVA_CHAT_TEMPLATE
    from tokenmill.models.loader import load_model_source

    folder = make_tiny_llava(tmp_path / "model", "clip")
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": LLAVA_CHAT_TEMPLATE}))
    assert load_model_source(str(folder)).chat_template == LLAVA_CHAT_TEMPLATE
