"""Beam search over the running engine for `use_beam_search` requests: each step runs every live beam of
every prompt as a one-token engine request, concurrently (engine/beam_search.py is the algorithm)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Optional

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.beam_search import (BeamSearch, BeamSearchOutput, BeamSearchParams, beam_step_params,
                                          top_logprobs, with_texts)
from tokenmill.lora.request import LoRARequest
from tokenmill.server.serving_common import new_id, with_adapter


async def run_beam_search(engine: AsyncEngine, prompts: list[list[int]], params: BeamSearchParams,
                          adapter: Optional[LoRARequest] = None) -> list[BeamSearchOutput]:
    """Each prompt's finished hypotheses, best first, with their text. Engine errors (ValueError for a
    prompt that cannot run, QueueFullError, ...) propagate; the step's other requests are aborted."""
    searches = [BeamSearch(ids, params, engine.info.eos_token_ids) for ids in prompts]
    step = with_adapter(beam_step_params(searches[0].num_candidates), adapter)
    base, counter = new_id("beam"), itertools.count()

    async def next_tokens(tokens: list[int]) -> dict[int, float]:
        final: Any = None
        async for output in engine.generate(f"{base}-{next(counter)}", tokens, step):
            final = output
        return top_logprobs(final)

    while any(not search.done for search in searches):
        live = [search for search in searches if not search.done]
        tops = iter(await asyncio.gather(*(next_tokens(beam) for search in live for beam in search.beam_prompts())))
        for search in live:
            search.advance([next(tops) for _ in search.running])
    return with_texts([search.output() for search in searches], engine.tokenizer)
