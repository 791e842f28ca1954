"""GPTQ against rounding to nearest, layer by layer: the relative squared output error ||(W - Q) X||^2 /
||W X||^2 of a few linear layers of the default model, on the calibration inputs (docs/, as
scripts/quantize_checkpoint.py calibrates) and on held-out inputs (tests/data/perplexity.txt and the quote
passages). docs/benchmarks.md ("Quantised checkpoints and an FP8 KV cache") quotes it.

    .venv/bin/python scripts/gptq_layer_error.py [--group-size 128] [--asymmetric]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quantize_checkpoint import ROOT, calibration_ids, gptq, load_float_model  # noqa: E402

LAYERS = ["model.layers.3.self_attn.q_proj", "model.layers.3.mlp.down_proj", "model.layers.20.mlp.gate_proj",
          "model.layers.20.self_attn.o_proj"]


def layer_inputs(hf, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each probed layer's inputs [tokens, in_features] (float64) over the runs of `ids`."""
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in LAYERS}
    hooks = [hf.get_submodule(name).register_forward_hook(
        lambda module, inputs, output, name=name: seen[name].append(inputs[0].reshape(-1, inputs[0].shape[-1]).double()))
        for name in LAYERS]
    with torch.no_grad():
        for row in range(ids.shape[0]):
            hf(ids[row:row + 1])
    for hook in hooks:
        hook.remove()
    return {name: torch.cat(parts) for name, parts in seen.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--asymmetric", action="store_true")
    parser.add_argument("--calibration", type=int, default=16, help="calibration runs of 512 tokens")
    args = parser.parse_args()
    hf, tokenizer = load_float_model(None)
    text = (ROOT / "tests" / "data" / "perplexity.txt").read_text()
    text += (ROOT / "src" / "tokenmill" / "bench" / "quote_passages.txt").read_text()
    held = tokenizer(text, return_tensors="pt").input_ids[0]
    held = held[:held.numel() // 256 * 256].view(-1, 256)
    calibration = layer_inputs(hf, calibration_ids(tokenizer, args.calibration, 512))
    held_out = layer_inputs(hf, held)
    print("| layer | method | calibration inputs | held-out inputs |\n|---|---|---|---|")
    for name in LAYERS:
        weight = hf.get_submodule(name).weight.data.double()
        x = calibration[name]
        for method, hessian in (("round to nearest", torch.eye(weight.shape[1], dtype=torch.float64)),
                                ("GPTQ", 2 * x.t() @ x / x.shape[0])):
            q, zeros, scales = gptq(weight.float(), hessian, args.group_size, not args.asymmetric)
            group = torch.arange(weight.shape[1]) // args.group_size
            dequantised = (q.double() - zeros.double()[:, group]) * scales.double()[:, group]

            def error(inputs: torch.Tensor) -> float:
                return float(((weight - dequantised) @ inputs.t()).pow(2).sum() / (weight @ inputs.t()).pow(2).sum())

            print(f"| {name} | {method} | {error(calibration[name]):.5f} | {error(held_out[name]):.5f} |")


if __name__ == "__main__":
    main()
