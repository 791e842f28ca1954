"""vLLM's metric names as aliases of tokenmill's, for the routers and dashboards built around vLLM
(vllm-router, the production-stack router, llm-d, sglang-router read `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc`, ...).

An alias is not a second metric: at every scrape it re-emits the tokenmill family it stands for under
vLLM's name (and vLLM's `finished_reason` label for `finish_reason`), so the two can never differ.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

PREFIX, VLLM_PREFIX = "tokenmill:", "vllm:"
# tokenmill family -> the vLLM names it is also published as (`gpu_cache_usage_perc`: vLLM's name before v1,
# which some routers still read)
ALIASES = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "prefix_cache_queries": ("prefix_cache_queries",),
    "prefix_cache_hits": ("prefix_cache_hits",),
    "num_preemptions": ("num_preemptions",),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "request_success": ("request_success",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("inter_token_latency_seconds",),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("request_queue_time_seconds",),
    "spec_decode_num_drafts": ("spec_decode_num_drafts",),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",),
}
_LABELS = {"finish_reason": "finished_reason"}


class VllmAliases:
    """A Prometheus collector publishing `sources` (tokenmill collectors) under vLLM's names too."""

    def __init__(self, sources: Iterable[Any]) -> None:
        self.sources = list(sources)

    def collect(self) -> Iterator[Metric]:
        """The aliased families, renamed, with the samples they have right now."""
        for source in self.sources:
            for family in source.collect():
                short = family.name.removeprefix(PREFIX)
                for alias in ALIASES.get(short, ()):
                    yield _renamed(family, short, alias)

    def describe(self) -> list[Metric]:
        """Nothing up front: the registry then checks no name clash, as tokenmill's and vLLM's never meet."""
        return []


def _renamed(family: Metric, short: str, alias: str) -> Metric:
    renamed = Metric(VLLM_PREFIX + alias, family.documentation, family.type, family.unit)
    old_prefix, new_prefix = PREFIX + short, VLLM_PREFIX + alias
    for sample in family.samples:
        labels = {_LABELS.get(name, name): value for name, value in sample.labels.items()}
        renamed.samples.append(Sample(new_prefix + sample.name[len(old_prefix):], labels, sample.value,
                                      sample.timestamp, sample.exemplar))
    return renamed
