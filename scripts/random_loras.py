"""Write random PEFT LoRA adapters for a model, to measure what serving adapters costs.

The adapters are PEFT's own files (adapter_config.json + adapter_model.safetensors), made by PEFT over the
model loaded in HF transformers (a GGUF file is dequantised by transformers), with A and B drawn from
N(0, 0.02) (seeded), so that every product is non-trivial.

    .venv/bin/python scripts/random_loras.py --count 4 --rank 16 --out /tmp/loras   # the default model
    .venv/bin/tokenmill bench throughput --enable-lora --max-loras 4 \\
        --lora-modules a=/tmp/loras/lora-0 b=/tmp/loras/lora-1 c=/tmp/loras/lora-2 d=/tmp/loras/lora-3
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: the default model)")
    parser.add_argument("--count", type=int, default=4, help="adapters to write (default: 4)")
    parser.add_argument("--rank", type=int, default=16, help="their rank (default: 16)")
    parser.add_argument("--targets", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj"],
                        help="projections they adapt (default: q_proj k_proj v_proj o_proj)")
    parser.add_argument("--out", required=True, help="folder to write lora-0, lora-1, ... into")
    args = parser.parse_args()

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tokenmill.models.loader.resolve import resolve_model_path

    path = resolve_model_path(args.model)
    if path.endswith(".gguf"):
        folder, name = os.path.split(path)
        base = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    else:
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=args.targets, lora_dropout=0.0,
                        init_lora_weights=False)
    model = get_peft_model(base, config)
    for index in range(args.count):
        generator = torch.Generator().manual_seed(index)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_" in param_name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        out = Path(args.out) / f"lora-{index}"
        model.save_pretrained(str(out))
        print(out)


if __name__ == "__main__":
    main()
