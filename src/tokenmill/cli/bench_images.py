"""What a vision-language model's image path costs, in one process.

`tokenmill bench images` sends one-image prompts (the model's chat template around one image and a short
question), one at a time, each with a fresh random image of --image-size pixels so that neither the encoder
cache nor the prefix cache helps, and records per prompt:

- **processor**: the model's HF image processor and the placeholder expansion (what the server does before a
  request arrives at the engine);
- **cold TTFT**: arrival to first token of the prompt with its new image (the vision encoder, the prefill);
- **cached TTFT**: the same prompt and image again at once (the image's blocks come from the prefix cache);
- **text TTFT**: a text-only prompt of the same length (the same prefill without an image).

It reports medians (ms), the image's positions, and images per second through the vision encoder (the
engine's encoder counters over the cold prompts: images / encoder seconds). --output-json writes them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from tqdm import tqdm

from tokenmill.bench.report import emit
from tokenmill.cli.engine_args import add_engine_args, engine_kwargs


def add_bench_images_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `tokenmill bench images` (and every engine flag)."""
    parser.add_argument("--image-size", type=int, nargs=2, default=[336, 336], metavar=("WIDTH", "HEIGHT"),
                        help="pixels of each random image (default: 336 336)")
    parser.add_argument("--repeats", type=int, default=10, help="prompts, each with its own image; medians are "
                                                               "shown (default: 10)")
    parser.add_argument("--image-seed", type=int, default=0, help="seed of the random images (default: 0)")
    parser.add_argument("--output-json", default=None, help="also write the results to this JSON file")
    add_engine_args(parser)


def run_bench_images(args: argparse.Namespace) -> int:
    """Run the measurement and print the medians."""
    import numpy as np
    from PIL import Image

    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm import LLM
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.sampling_params import SamplingParams

    llm = LLM.from_engine(LLMEngine(EngineConfig.from_kwargs(**engine_kwargs(args))))
    engine = llm.llm_engine
    if engine.image_processing is None:
        raise SystemExit(f"tokenmill bench images needs a vision-language model; {engine.source.path} is text-only")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}]
    prompt = llm.apply_chat_template(messages)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(args.image_seed)
    width, height = args.image_size
    vocab = engine.arch.vocab_size

    def ttft(request: Any) -> tuple[float, Any]:
        output = llm.generate(request, one, use_tqdm=False)[0]
        return output.metrics.first_token_time - output.metrics.arrival_time, output

    llm.generate({"prompt": prompt, "multi_modal_data": {"image": Image.new("RGB", (width, height))}}, one,
                 use_tqdm=False)  # warm-up: first-call costs (kernels, the processor) are not the image's
    cold, cached, text, processor, positions = [], [], [], [], 0
    prompt_ids = engine.tokenize(prompt)
    images_before, seconds_before = engine.encoder_totals
    for _ in tqdm(range(args.repeats), desc="one-image prompts"):
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        started = time.perf_counter()
        ids, features = engine.prepare_images(prompt_ids, [image])
        processor.append(time.perf_counter() - started)
        request = {"prompt_token_ids": ids, "multi_modal_data": {"image": features}}  # processed once, above
        elapsed, output = ttft(request)
        cold.append(elapsed)
        positions = output.prompt_token_ids.count(engine.image_processing.image_token_id)
        cached.append(ttft(request)[0])
        text.append(ttft({"prompt_token_ids": rng.integers(0, vocab, len(output.prompt_token_ids)).tolist()})[0])
    images, seconds = engine.encoder_totals[0] - images_before, engine.encoder_totals[1] - seconds_before

    def ms(values: list[float]) -> float:
        return round(1000 * statistics.median(values), 2)

    emit({"model": engine.source.path, "dtype": str(engine.dtype).replace("torch.", ""),
          "image_size": [width, height], "image_positions": positions, "prompt_tokens": len(output.prompt_token_ids),
          "repeats": args.repeats, "processor_ms": ms(processor), "cold_ttft_ms": ms(cold), "cached_ttft_ms": ms(cached),
          "text_ttft_ms": ms(text), "encoder_images": images,
          "encoder_images_per_s": round(images / seconds, 2) if seconds else None,
          "encoder_ms_per_image": round(1000 * seconds / images, 2) if images else None}, args.output_json)
    return 0
