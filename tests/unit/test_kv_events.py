"""Block hashes as vLLM computes them, the prefix cache's event log, and --kv-events-config (no torch)."""

from __future__ import annotations

import pytest

from tokenmill.core.block_hash import external_hash, hash_block, none_hash, resolve_seed, salt_keys
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored
from tokenmill.kv_events_config import KVEventsConfig
from tokenmill.sampling_params import SamplingParams

# Known answers computed by vLLM 0.32 (vllm.v1.core.kv_cache_utils.hash_block_tokens with
# vllm.utils.hashing.sha256_cbor after init_none_hash; PYTHONHASHSEED unset unless said).
VLLM_NONE_HASH = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
VLLM_FIRST = "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749"  # tokens 0..15
VLLM_SECOND = "c300ec275d7bf08af8fc63e76cdc0086911bbc7091e03c5cf892553bef84ef0c"  # then 16..31
VLLM_SALTED = "f48a9bde36dd58e71d127c848f27aa2baaa237ec04c8c38ee9c9a8fbb5c17ce2"  # 0..15, cache_salt "abc"
VLLM_SEED_42 = "0a99040f25d8a5f22275b867f403918da98c9d140eaea10f5319d4d1d84429df"  # [1, 2, 3, 4], PYTHONHASHSEED=42


def test_block_hashes_equal_vllms_sha256_cbor_hashes(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    root = none_hash(resolve_seed(None))
    assert root.hex() == VLLM_NONE_HASH
    first = hash_block(root, range(16))
    assert first.hex() == VLLM_FIRST
    assert hash_block(first, range(16, 32)).hex() == VLLM_SECOND
    assert hash_block(root, range(16), salt_keys("abc")).hex() == VLLM_SALTED
    assert external_hash(first) == 2233398808101521225  # vLLM's int form: the low 64 bits
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert hash_block(none_hash(resolve_seed(None)), [1, 2, 3, 4]).hex() == VLLM_SEED_42
    assert hash_block(none_hash(resolve_seed("42")), [1, 2, 3, 4]).hex() == VLLM_SEED_42


class Seq:
    """A request as the KV cache manager sees it."""

    def __init__(self, request_id, tokens, salt=None):
        self.request_id, self.tokens = request_id, list(tokens)
        self.num_computed_tokens, self.num_tokens = 0, len(self.tokens)
        self.sampling_params = SamplingParams(cache_salt=salt)
        self.images = ()

    def token_ids_range(self, start, end):
        return self.tokens[start:end]


def run_prefill(kv, seq):
    """Admit `seq` with whatever prefix it hits, compute it all and register its blocks."""
    cached, hit = kv.match_prefix(seq, seq.num_tokens)
    assert kv.allocate_slots(seq.request_id, seq.num_tokens, cached)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_computed_blocks(seq)
    return hit


def test_the_log_says_which_blocks_became_findable_and_which_were_evicted():
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=True, record_events=True)
    assert [type(e) for e in kv.events.drain()] == [AllBlocksCleared]  # a new cache starts empty
    a = Seq("a", [1, 2, 3, 4, 5])
    run_prefill(kv, a)
    (stored,) = kv.events.drain()
    root = none_hash(resolve_seed(None))
    first = hash_block(root, [1, 2])
    second = hash_block(first, [3, 4])
    assert stored == BlocksStored(0, [first, second], None, [1, 2, 3, 4], [None, None])

    b = Seq("b", [1, 2, 3, 4, 5, 6, 7])  # shares both blocks: nothing new until its own block is full
    assert run_prefill(kv, b) == 4
    (stored,) = kv.events.drain()
    assert stored == BlocksStored(0, [hash_block(second, [5, 6])], second, [5, 6], [None])

    kv.free("a")
    kv.free("b")
    c = Seq("c", [9] * 11)  # needs every block: the three cached ones are evicted
    run_prefill(kv, c)
    removed, stored = kv.events.drain()
    assert isinstance(removed, BlocksRemoved)
    assert sorted(removed.hashes) == sorted([first, second, hash_block(second, [5, 6])])
    assert isinstance(stored, BlocksStored) and stored.token_ids == [9] * 10


def test_a_salted_first_block_carries_its_salt_and_a_different_hash():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True, record_events=True)
    kv.events.drain()
    run_prefill(kv, Seq("s", [1, 2, 3, 4, 5], salt="tenant-1"))
    (stored,) = kv.events.drain()
    assert stored.extra_keys == [(("cache_salt", "tenant-1"),), None]
    assert stored.hashes[0] == hash_block(none_hash(resolve_seed(None)), [1, 2], salt_keys("tenant-1"))


def test_without_events_nothing_is_recorded():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    run_prefill(kv, Seq("a", [1, 2, 3]))
    assert kv.events is None


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown keys ['endpont']"),
    ('{"publisher": "kafka"}', "publisher must be one of"),
    ('{"endpoint": "http://x:1"}', "endpoint must be a tcp://"),
    ('{"buffer_steps": 0}', "buffer_steps must be an integer >= 1"),
])
def test_a_bad_kv_events_config_is_refused_by_name(text, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        KVEventsConfig.parse(text)


def test_kv_events_config_defaults_and_rank_offsets_follow_vllm():
    assert not KVEventsConfig.parse(None).active
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5558"}')
    assert config.active and config.endpoint == "tcp://*:5557" and config.topic == ""
    assert KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "null"}).active is False
    second = config.for_rank(2)
    assert (second.endpoint, second.replay_endpoint) == ("tcp://*:5559", "tcp://*:5560")
    ipc = KVEventsConfig.parse({"enable_kv_cache_events": True, "endpoint": "ipc:///tmp/ev"}).for_rank(1)
    assert ipc.endpoint == "ipc:///tmp/ev_dp1"
