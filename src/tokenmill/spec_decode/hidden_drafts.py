"""Building the drafts that read the target's hidden states: an EAGLE-3 head (models/eagle3.py) and the model's own
multi-token prediction layer (models/mtp.py), each a DraftProposer over its own one-layer paged KV cache, fed by
the target runner's `hidden_tap` (spec_decode/hidden_states.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from tokenmill.attention import get_attention_backend
from tokenmill.config import EngineConfig
from tokenmill.spec_decode.draft import DraftProposer
from tokenmill.spec_decode.hidden_states import HiddenStates

logger = logging.getLogger(__name__)


def hidden_state_proposer(config: EngineConfig, engine: Any, draft_blocks: int) -> DraftProposer:
    """The proposer of speculative_method eagle3 or mtp for `engine` (an in-process LLMEngine); the target's runner
    records the hidden states the draft reads from now on."""
    try:
        runner = engine.runner
    except AttributeError:
        raise ValueError(f"speculative_method {config.speculative.speculative_method!r} reads the target's hidden "
                         "states in the engine's process: it runs with one rank (distributed_executor_backend uni)"
                         ) from None
    target = runner.model
    if not hasattr(target, "aux_hidden_layers"):
        raise ValueError(f"speculative_method {config.speculative.speculative_method!r}: {engine.arch.architecture} "
                         "does not expose its hidden states")
    from tokenmill.worker.model_setup import resolve_batch_invariant

    device, dtype = engine.device, engine.dtype
    invariant = resolve_batch_invariant(config.model.batch_invariant, device)
    backend, _ = get_attention_backend(config.model.attention_backend, device, dtype, invariant)
    max_positions = engine.max_model_len + config.speculative.num_speculative_tokens
    if config.speculative.speculative_method == "eagle3":
        draft, rows_of = _eagle3_head(config, engine, target, backend, max_positions)
        # a CUDA graph's replay would not keep the taps: steps run eagerly
        runner.graphs = runner.mixed_graphs = None
    else:
        draft, rows_of = _mtp_layer(config, engine, backend, max_positions), (lambda hidden: hidden)
    draft.apply_kernels(target.kernel_choice)
    draft.eval()
    states = HiddenStates(rows_of)
    runner.hidden_tap = states
    return DraftProposer(draft, backend, draft_blocks, engine.kv_cache.block_size, dtype, device,
                         engine.eos_token_ids, config.model.seed,
                         lambda: engine.step_grammars.matchers if engine.step_grammars is not None else None,
                         hidden=states)


def _built(device: torch.device, dtype: torch.dtype, make: Callable[[], Any]) -> Any:
    """`make()` with its parameters created on `device` in `dtype`."""
    with torch.device(device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            return make()
        finally:
            torch.set_default_dtype(previous)


def _eagle3_head(config: EngineConfig, engine: Any, target: Any, backend: Any, max_positions: int):
    from tokenmill.models.eagle3 import Eagle3Head, aux_layer_ids, read_eagle3_config
    from tokenmill.models.loader.resolve import resolve_model_path

    folder = resolve_model_path(config.speculative.draft_model)
    head_config, arch = read_eagle3_config(folder)
    if arch.vocab_size != engine.arch.vocab_size:
        raise ValueError(f"the EAGLE-3 head's vocab_size {arch.vocab_size} is not the target's "
                         f"{engine.arch.vocab_size}")
    target_hidden = int(head_config.get("target_hidden_size") or arch.hidden_size)
    if target_hidden != engine.arch.hidden_size:
        raise ValueError(f"the EAGLE-3 head reads hidden states of width {target_hidden}, the target's are "
                         f"{engine.arch.hidden_size} wide")
    layers = aux_layer_ids(head_config, engine.arch.num_hidden_layers)
    head = _built(engine.device, engine.dtype,
                  lambda: Eagle3Head(arch, head_config, backend, max_positions, target.embed))
    head.load_weights(_folder_tensors(Path(folder)))
    head.rotary.to_device(engine.device)
    target.aux_hidden_layers = layers
    logger.info("EAGLE-3 head %s: reads the target's layers %s, proposes from %d tokens", folder, list(layers),
                head.draft_vocab_size)
    return head, lambda hidden: head.combine(target.aux_hidden)


def _folder_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a head's safetensors files, or of its pytorch_model.bin (EAGLE-3 heads ship either)."""
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        for file in files:
            yield from load_file(str(file)).items()
        return
    binary = folder / "pytorch_model.bin"
    if not binary.is_file():
        raise ValueError(f"the EAGLE-3 head {str(folder)!r} has no *.safetensors nor pytorch_model.bin")
    yield from torch.load(binary, map_location="cpu", weights_only=True).items()


def _mtp_layer(config: EngineConfig, engine: Any, backend: Any, max_positions: int):
    from tokenmill.models.loader.resolve import resolve_model_path
    from tokenmill.models.mtp import MultiTokenPredictor, mtp_layer_index

    named = config.speculative.draft_model
    if named is not None and resolve_model_path(named) != str(Path(engine.source.path).resolve()):
        raise ValueError(f"speculative_method 'mtp' drafts with the target's own layers: model {named!r} is not the "
                         "target (give none)")
    index = mtp_layer_index(engine.source.path, engine.arch)
    layer = _built(engine.device, engine.dtype,
                   lambda: MultiTokenPredictor(engine.arch, index, backend, max_positions))
    layer.load_weights(engine.source.iter_weights(keep_quantized=True))
    layer.block.rotary.to_device(engine.device)
    logger.info("multi-token prediction: layer %d of %s drafts", index, engine.source.path)
    return layer
