"""Draft-model proposals: a second model, with its own paged KV cache, proposes k tokens autoregressively."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_spec import single_group
from tokenmill.models.arch import kv_cache_spec
from tokenmill.request import Request
from tokenmill.sampling.rejection import draw
from tokenmill.sampling.sampler import adjust_logits, filtered_probs, row_argmax
from tokenmill.spec_decode.controller import Draft
from tokenmill.spec_decode.hidden_states import HiddenStates
from tokenmill.structured.matchers import GrammarMatchers
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.request_state import BatchItem


def draft_seed(seed: int) -> int:
    """The seed of a seeded request's draft generator: a fixed scramble of its own seed (an LCG step)."""
    return (seed * 6364136223846793005 + 1442695040888963407) % (1 << 63)


class DraftProposer:
    """Runs the draft model over each speculating request and records what it proposed.

    The draft keeps its own block tables (a KVCacheManager over its own pool, no prefix caching) and KV
    tensors. Per request it remembers how many leading tokens its cache holds; before proposing that
    count falls to the target's num_computed_tokens when lower, which discards the draft KV of rejected
    proposals (and everything after a preemption). One forward pass catches each request up to the end
    of its sequence and yields the first proposal; each further proposal is one decode pass.

    With `hidden` (an EAGLE-3 head or an MTP layer, spec_decode/hidden_states.py) the draft reads a hidden state
    beside each token: at draft position i, token i+1 and the target's hidden state at position i, so the draft's
    KV covers the positions before the target's last (num_tokens - 1 of them) and the first proposal comes from
    the last of them. Only positions fed the target's hidden states count as cached: the chained proposals'
    positions (fed the draft's own states) are written again at the next proposal.

    Greedy requests get the draft's argmax. Sampling requests draw from the draft's distribution under
    their own sampling controls, and that distribution goes with the proposals (in the step) to the
    target runner for the rejection rule. Constrained requests propose only what their grammars allow
    (`grammars` gives the engine's matchers, None before the first constrained request).
    """

    def __init__(self, model: Any, backend: Any, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, eos_token_ids: tuple[int, ...], seed: int,
                 grammars: Callable[[], Optional[GrammarMatchers]], hidden: Optional[HiddenStates] = None) -> None:
        arch = model.arch
        self.kv = KVCacheManager(num_blocks, block_size, watermark=0.0)
        # A seeded request's draft generator gets a scrambled seed: the draft's choices must be
        # independent of the acceptance draws the target makes with the request's own seed.
        layout = single_group(len(model.layers), kv_cache_spec(arch, dtype.itemsize))
        self.runner = ModelRunner(model, backend, num_blocks, block_size, layout, dtype, device,
                                  eos_token_ids, seed + 1, request_seed=draft_seed)
        self.grammars = grammars
        self.cached: dict[str, int] = {}  # request id -> leading tokens whose draft KV is valid
        self.hidden = hidden

    def forget(self, request_id: str) -> None:
        """Free a finished (or preempted) request's draft KV."""
        self.kv.free(request_id)
        self.cached.pop(request_id, None)
        self.runner.generators.pop(request_id, None)
        if self.hidden is not None:  # (preempted: the target's recomputation records its rows again)
            self.hidden.drop([request_id])

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, Draft]:
        """Up to `room` proposals for each (request, room); a request whose draft KV does not fit gets none."""
        items, rooms, feeds = [], [], []
        for request, room in wanted:
            item, feed = self._catch_up(request, room) if self.hidden is None else self._catch_up_hidden(request, room)
            if item is not None:
                items.append(item)
                rooms.append(room)
                feeds.append(feed)
        step_hidden = torch.cat(feeds) if self.hidden is not None and feeds else None
        drafts: dict[str, list[int]] = {item.request_id: [] for item in items}
        probs: dict[str, list[torch.Tensor]] = {item.request_id: [] for item in items}
        grammars = self._grammar_forks(items)
        step = 0
        while items:
            if step_hidden is not None:
                self.runner.model.step_hidden = step_hidden
            hidden, chunks = self.runner.forward(items)
            last = torch.tensor([c.query_start + c.query_len - 1 for c in chunks], dtype=torch.long)
            states = hidden[last]
            logits = self.runner.model.compute_logits(states)
            constrained = [(row, grammars[item.request_id]) for row, item in enumerate(items)
                           if item.request_id in grammars]
            if constrained:
                self.grammars().mask_with(logits, constrained)
            for item, token, dist in zip(items, *self._pick(items, logits)):
                drafts[item.request_id].append(token)
                if item.request_id in grammars and not grammars[item.request_id].is_terminated():
                    grammars[item.request_id].accept_token(token)
                if dist is not None:
                    probs[item.request_id].append(dist)
            step += 1
            following = [(item, room) for item, room in zip(items, rooms) if room > step]
            if step_hidden is not None:  # a chained position reads the draft's own state before it
                step_hidden = states[[k for k, room in enumerate(rooms) if room > step]]
            items = [self._next(item, drafts[item.request_id][-1]) for item, _ in following]
            rooms = [room for _, room in following]
        return {request_id: Draft(tokens, torch.stack(probs[request_id]) if probs[request_id] else None)
                for request_id, tokens in drafts.items()}

    def _grammar_forks(self, items: list[BatchItem]) -> dict[str, Any]:
        """Copies of the engine's grammar matchers of the constrained requests: the draft proposes only
        what their grammars allow (its distribution is then the masked one, which verification uses)."""
        grammars = self.grammars()
        if grammars is None:
            return {}
        forks = {}
        for item in items:
            if item.sampling_params.structured_output is not None:
                fork = grammars.fork(item.request_id)
                if fork is not None:
                    forks[item.request_id] = fork
        return forks

    def _catch_up(self, request: Request, room: int) -> tuple[Optional[BatchItem], None]:
        """The chunk feeding the draft every token it lacks, with blocks for the room-1 proposals fed after."""
        rid = request.request_id
        cached = min(self.cached.get(rid, 0), request.num_computed_tokens)
        self.kv.trim(rid, cached)
        end = request.num_tokens
        if not self.kv.allocate_slots(rid, end + room - 1):
            self.forget(rid)
            return None, None
        self.cached[rid] = end + room - 1  # once all proposals but the last are fed
        return BatchItem(rid, request.token_ids_range(cached, end), cached, self.kv.block_tables(rid), True,
                                request.sampling_params, request.prompt_token_ids,
                                list(request.output_token_ids)), None

    def _catch_up_hidden(self, request: Request, room: int) -> tuple[Optional[BatchItem], Optional[torch.Tensor]]:
        """A hidden-state draft's chunk: positions [cached, num_tokens - 1) fed tokens [cached + 1, num_tokens)
        and the target's hidden rows of those positions, with blocks for the room-1 chained positions after;
        (None, None) while the target's rows of those positions are not all held (then it does not speculate)."""
        rid = request.request_id
        end = request.num_tokens - 1  # positions the target computed: each has its hidden state and next token
        cached = min(self.cached.get(rid, 0), request.num_computed_tokens, end - 1)  # >= 1 position to feed
        if not self.hidden.holds(rid, cached, end):
            return None, None
        self.kv.trim(rid, cached)
        if not self.kv.allocate_slots(rid, end + room - 1):
            self.forget(rid)
            return None, None
        self.cached[rid] = end  # the chained positions after it are fed the draft's own states
        rows = self.hidden.take(rid, cached, end)
        return BatchItem(rid, request.token_ids_range(cached + 1, end + 1), cached, self.kv.block_tables(rid),
                         True, request.sampling_params, request.prompt_token_ids,
                         list(request.output_token_ids)), rows

    @staticmethod
    def _next(item: BatchItem, token: int) -> BatchItem:
        """The decode chunk feeding `token` (the latest proposal) after `item`."""
        output = item.output_token_ids + [token]  # proposals count as output for penalties and min_tokens
        return BatchItem(item.request_id, [token], item.start + item.num_tokens, item.block_ids, True,
                                item.sampling_params, item.prompt_token_ids, output)

    def _pick(self, items: list[BatchItem], logits: torch.Tensor):
        """Each item's proposal, and for sampling requests the distribution it was drawn from."""
        rows = [self.runner.sampling_row(item) for item in items]
        adjusted = adjust_logits(logits, rows)
        tokens = row_argmax(adjusted).tolist()
        dists: list[Optional[torch.Tensor]] = [None] * len(items)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            probs = filtered_probs(adjusted[random_rows], [rows[i].params for i in random_rows])
            for row, i in enumerate(random_rows):
                generator = rows[i].generator or self.runner.default_generator
                tokens[i] = draw(probs[row], generator)
                dists[i] = probs[row]
        return tokens, dists
