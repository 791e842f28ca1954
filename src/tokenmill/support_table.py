"""README's table of what each architecture supports, asked of the code that enforces each column.

Every architecture's record (models/support.py) gives a small representative config; its `ArchConfig` is read
by the loader (hf_config.py) and each cell is what the engine's own check answers for it: tensor / pipeline /
expert parallelism from `check_divisible` (the start-time refusal), prefix caching and speculation from
`config_checks.for_model` (and models/mtp.py's architecture check), GGUF from the GGUF loader's architecture
maps, the GPU notes from layers/moe.py's `unfused_experts` and whether the KV layout keeps recurrent states
(the worker captures no CUDA graphs then). A "no" cites the refusal the engine gives, so the table changes
exactly when the engine does. `scripts/support_table.py --write` rewrites README's block; a unit test
(tests/unit/test_support_table.py) fails while README's block differs from `support_table_markdown()`.

It asks worker/worker.py's check, so it sits in the worker's layer (tests/unit/test_layering.py), at the
package's top level: it is no part of a rank.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

from tokenmill.config import SPECULATIVE_METHODS, EngineConfig, SpeculativeConfig
from tokenmill.config_checks import for_model
from tokenmill.layers.moe import unfused_experts
from tokenmill.models.arch import ArchConfig, kv_cache_layout
from tokenmill.models.loader.gguf_file import GGUF_ARCHITECTURES, GGUF_EXPERT_ARCHITECTURES
from tokenmill.models.loader.hf_config import SUPPORTED_ARCHITECTURES, arch_config_from_hf_dict
from tokenmill.models.mtp import check_mtp_architecture
from tokenmill.models.support import ARCHITECTURE_SUPPORT, PROBE_SHAPE
from tokenmill.models.vision.config import VISION_ARCHITECTURES
from tokenmill.worker.worker import check_divisible

START, END = "<!-- support-table:start -->", "<!-- support-table:end -->"
WRITE_COMMAND = "python scripts/support_table.py --write"
_HEADER = ("Architecture", "Models (example checkpoint)", "Weights", "TP", "PP", "EP", "Prefix caching",
           "Speculation", "GPU (Triton)")
_EAGER = ("a recurrent state's per-request loop is not captured in CUDA graphs: these models' steps run "
          "eagerly on CUDA")
_DRAFT_MODEL = "draft"  # eagle3 and draft need a draft model to be named; the check does not open it


def representative_arch(architecture: str) -> ArchConfig:
    """The `ArchConfig` the loader reads from `architecture`'s representative config (PROBE_SHAPE, the record's
    probe settings, transformers' defaults for the rest)."""
    settings = {"architectures": [architecture], **PROBE_SHAPE, **ARCHITECTURE_SUPPORT[architecture].probe}
    return arch_config_from_hf_dict(settings, Path(os.devnull))  # (no generation_config.json under it)


class _Notes:
    """The refusals the cells cite, numbered in the order first cited."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def cite(self, text: str) -> str:
        """`text`'s number, as a cell shows it."""
        if text not in self.texts:
            self.texts.append(text)
        return f"({self.texts.index(text) + 1})"


def _refusal(check: Callable[[], object], arch: ArchConfig) -> Optional[str]:
    """What `check` refuses with (the model's name said generically, so models refused alike share a note),
    or None."""
    try:
        check()
    except ValueError as refused:
        return str(refused).replace(arch.architecture, "the model")
    return None


def _yes_or_cited(check: Callable[[], object], arch: ArchConfig, notes: _Notes) -> str:
    refused = _refusal(check, arch)
    return "yes" if refused is None else f"no {notes.cite(refused)}"


def _weights(architecture: str) -> str:
    gguf = {*GGUF_ARCHITECTURES.values(), *GGUF_EXPERT_ARCHITECTURES.values()}
    return "safetensors, GGUF" if architecture in gguf else "safetensors"


def _expert_parallel(arch: ArchConfig, notes: _Notes) -> str:
    if _refusal(lambda: check_divisible(arch, 1, expert_parallel=True), arch) is not None:
        return "—"  # no experts to shard
    return _yes_or_cited(lambda: check_divisible(arch, 2, expert_parallel=True), arch, notes)


def _prefix_caching(arch: ArchConfig) -> str:
    return "yes" if for_model(EngineConfig(), arch).cache.prefix_caching else "off"


def _speculation(arch: ArchConfig, notes: _Notes) -> str:
    allowed, refusals = [], []
    for method in SPECULATIVE_METHODS[1:]:  # (the first is "none")
        draft = _DRAFT_MODEL if method in ("draft", "eagle3") else None
        config = EngineConfig(speculative=SpeculativeConfig(speculative_method=method, draft_model=draft))
        refused = _refusal(lambda: for_model(config, arch), arch)
        if refused is None and method == "mtp":
            refused = _refusal(lambda: check_mtp_architecture(arch.architecture), arch)
            if refused is not None:
                continue  # only the models with such a layer: the cell lists it where it applies
        if refused is None:
            allowed.append(method)
        else:
            refusals.append(refused)
    return ", ".join(allowed) if allowed else f"no {notes.cite(refusals[0])}"


def _gpu(arch: ArchConfig, notes: _Notes) -> str:
    # the worker's condition for capturing no CUDA graphs
    parts = [f"eager {notes.cite(_EAGER)}" if kv_cache_layout(arch, 2).state_groups else "CUDA graphs"]
    if arch.moe is not None:
        unfused = unfused_experts(arch.moe)
        parts.append("fused MoE" if unfused is None else
                     f"experts one by one {notes.cite(f'{unfused} have no fused Triton MoE kernel')}")
    return ", ".join(parts)


def _text_cells(arch: ArchConfig, notes: _Notes) -> list[str]:
    """TP, PP, EP, prefix caching, speculation and GPU cells of a decoder."""
    return [_yes_or_cited(lambda: check_divisible(arch, 2), arch, notes),
            _yes_or_cited(lambda: check_divisible(arch, 1, pp_size=2), arch, notes),
            _expert_parallel(arch, notes), _prefix_caching(arch), _speculation(arch, notes), _gpu(arch, notes)]


def support_rows() -> tuple[list[list[str]], list[str]]:
    """The table's rows (text architectures in SUPPORTED_ARCHITECTURES' order, then the vision-language ones)
    and the notes their cells cite."""
    notes, rows = _Notes(), []
    for architecture in (*SUPPORTED_ARCHITECTURES, *VISION_ARCHITECTURES):
        support = ARCHITECTURE_SUPPORT[architecture]
        models = f"{support.family} (`{support.example}`)"
        if not support.vision:
            cells = _text_cells(representative_arch(architecture), notes)
        elif support.decoder is not None:
            models += f"; its decoder is `{support.decoder}`'s"
            cells = _text_cells(representative_arch(support.decoder), notes)
        else:  # its text_config names the decoder: that architecture's row holds
            models += "; its decoder is any architecture above, as its text_config names"
            cells = ["as decoder"] * 6
        rows.append([f"`{architecture}`", models, _weights(architecture), *cells])
    return rows, notes.texts


def support_table_markdown() -> str:
    """README's block: the table and its numbered notes (what the engine answers where a cell says no)."""
    rows, notes = support_rows()
    lines = [f"| {' | '.join(_HEADER)} |", f"|{'---|' * len(_HEADER)}",
             *(f"| {' | '.join(row)} |" for row in rows), ""]
    lines += [f"{number}. {text}" for number, text in enumerate(notes, 1)]  # what a cell's "(number)" cites
    return "\n".join(lines) + "\n"


def readme_block(readme: str) -> str:
    """The text between README's markers; ValueError naming the marker when one is missing."""
    for marker in (START, END):
        if marker not in readme:
            raise ValueError(f"README has no {marker} marker")
    return readme.split(START, 1)[1].split(END, 1)[0].removeprefix("\n")


def with_generated_block(readme: str) -> str:
    """`readme` with the text between its markers replaced by `support_table_markdown()`."""
    readme_block(readme)  # both markers present
    before, rest = readme.split(START, 1)
    after = rest.split(END, 1)[1]
    return f"{before}{START}\n{support_table_markdown()}{END}{after}"
