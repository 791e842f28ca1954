"""Prefill/decode disaggregation through shared files and over TCP: the decode engine's output is the single
engine's, and a transfer that cannot be used is a local prefill, never a different answer."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket

import pytest

from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu_kernels import cpu_kernels

BLOCK = 4
PROMPT = list(range(1, 40))  # 9 full blocks before the last token
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

pytestmark = pytest.mark.every_level


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama"))


def transfer_config(folder) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(folder)}}


@pytest.fixture(scope="module")
def engines(model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv")
    single = LLM(model_path, block_size=BLOCK, num_kv_blocks=64)
    producer = LLM(model_path, block_size=BLOCK, num_kv_blocks=64, kv_transfer_config=transfer_config(folder))
    consumer = LLM(model_path, block_size=BLOCK, num_kv_blocks=64, kv_transfer_config=transfer_config(folder))
    return single, producer, consumer, folder


def prefill_remotely(producer, prompt):
    (out,) = producer.generate({"prompt_token_ids": prompt}, SamplingParams(
        max_tokens=1, kv_transfer_params={"do_remote_decode": True}), use_tqdm=False)
    return out.kv_transfer_params


def decode(consumer, prompt, transfer):
    (out,) = consumer.generate({"prompt_token_ids": prompt}, dataclasses.replace(GREEDY, kv_transfer_params=transfer),
                               use_tqdm=False)
    return out


def answer(out):
    completion = out.outputs[0]
    return completion.token_ids, [{t: lp.logprob for t, lp in entry.items()} for entry in completion.logprobs]


def assert_same_answer(out, reference) -> None:
    """The single engine's answer: its bits with the native kernels (batch-invariant products: a prefix hit changes
    nothing); without them (TOKENMILL_KERNELS=off) the ids, and logprobs within 1e-4, since F.linear's sums may
    depend on how many rows a step multiplies (the imported prompt's last tokens run as a 3-row chunk)."""
    if cpu_kernels() is not None:
        assert answer(out) == answer(reference)
        return
    (ids, logprobs), (expected_ids, expected) = answer(out), answer(reference)
    assert ids == expected_ids
    for got, want in zip(logprobs, expected):
        assert got.keys() == want.keys() and all(abs(got[t] - want[t]) <= 1e-4 for t in got)


def test_the_decode_engine_continues_from_the_transferred_blocks_with_the_single_engines_output(engines):
    single, producer, consumer, folder = engines
    (reference,) = single.generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False)
    transfer = prefill_remotely(producer, PROMPT)
    assert transfer["do_remote_prefill"] is True and transfer["remote_num_blocks"] == 9
    assert os.path.exists(transfer["remote_kv_path"])
    out = decode(consumer, PROMPT, transfer)
    assert_same_answer(out, reference)
    assert out.metrics.num_cached_tokens == 9 * BLOCK  # the prompt came from the transfer, not a prefill
    assert not os.path.exists(transfer["remote_kv_path"]), "an imported file is removed"


DAMAGES = ["flip a byte", "truncate", "another prompt", "missing", "outside the folder"]


@pytest.mark.parametrize("damage", DAMAGES)
def test_an_unusable_transfer_is_a_local_prefill_with_the_same_answer(engines, damage, tmp_path):
    single, producer, consumer, folder = engines
    prompt = [100 + DAMAGES.index(damage)] * 3 + PROMPT[3:]  # its own: no block of it is cached anywhere yet
    (reference,) = single.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    transfer = prefill_remotely(producer, prompt if damage != "another prompt" else PROMPT[::-1])
    path = transfer["remote_kv_path"]
    if damage == "flip a byte":
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(path, "wb").write(bytes(data))
    elif damage == "truncate":
        os.truncate(path, os.path.getsize(path) - 1)
    elif damage == "missing":
        os.remove(path)
    elif damage == "outside the folder":
        transfer = {**transfer, "remote_kv_path": str(tmp_path / os.path.basename(path))}
    refused = consumer.llm_engine.kv_transfers.num_refused
    out = decode(consumer, prompt, transfer)
    assert_same_answer(out, reference)
    assert consumer.llm_engine.kv_transfers.num_refused == refused + 1
    assert out.metrics.num_cached_tokens == 0


def test_transfer_params_are_refused_by_name_where_they_cannot_work(engines, model_path):
    single, producer, *_ = engines
    with pytest.raises(ValueError, match="no --kv-transfer-config"):
        single.generate({"prompt_token_ids": PROMPT}, SamplingParams(kv_transfer_params={"do_remote_decode": True}))
    with pytest.raises(ValueError, match="n must be 1"):
        producer.generate({"prompt_token_ids": PROMPT},
                          SamplingParams(n=2, kv_transfer_params={"do_remote_decode": True}))
    with pytest.raises(ValueError, match="kv_role must be one of"):
        LLM(model_path, kv_transfer_config={"kv_connector": "SharedStorageConnector", "kv_role": "both",
                                            "kv_connector_extra_config": {"shared_storage_path": "/tmp/x"}})


TCP = {"kv_connector": "TCPConnector"}


@pytest.fixture(scope="module")
def tcp_engines(model_path, engines, tmp_path_factory):
    copy = tmp_path_factory.mktemp("copy") / "model"
    shutil.copytree(model_path, copy)  # the same files at another path: the same model
    other = make_tiny_hf_model(tmp_path_factory.mktemp("other"), arch="llama", rms_norm_eps=1e-5)
    producer = LLM(model_path, block_size=BLOCK, num_kv_blocks=64,
                   kv_transfer_config={**TCP, "kv_role": "kv_producer", "kv_port": 0})
    elsewhere = LLM(str(copy), block_size=BLOCK, num_kv_blocks=64,
                    kv_transfer_config={**TCP, "kv_role": "kv_producer", "kv_port": 0})
    foreign = LLM(str(other), block_size=BLOCK, num_kv_blocks=64,
                  kv_transfer_config={**TCP, "kv_role": "kv_producer", "kv_port": 0})
    consumer = LLM(model_path, block_size=BLOCK, num_kv_blocks=64,
                   kv_transfer_config={**TCP, "kv_role": "kv_consumer",
                                       "kv_connector_extra_config": {"fetch_timeout_s": 30}})
    yield engines[0], producer, elsewhere, foreign, consumer
    for llm in (producer, elsewhere, foreign, consumer):
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("where", ["same path", "another path"])
def test_over_tcp_the_decode_engine_continues_with_the_single_engines_output(tcp_engines, where):
    single, same, elsewhere, _, consumer = tcp_engines
    producer = same if where == "same path" else elsewhere
    prompt = [7 if where == "same path" else 8] + PROMPT[1:]
    (reference,) = single.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    transfer = prefill_remotely(producer, prompt)
    assert transfer["remote_port"] == producer.llm_engine.kv_transfers.server.port
    assert "remote_kv_path" not in transfer and transfer["remote_num_blocks"] == 9
    out = decode(consumer, prompt, transfer)
    assert_same_answer(out, reference)
    assert out.metrics.num_cached_tokens == 9 * BLOCK
    assert os.listdir(producer.llm_engine.kv_transfers.folder) == []  # sent, so gone
    assert os.listdir(consumer.llm_engine.kv_transfers.folder) == []  # imported, so gone


TCP_DAMAGES = ["taken already", "another model", "another prompt", "producer gone", "malformed", "a path elsewhere"]


@pytest.mark.parametrize("damage", TCP_DAMAGES)
def test_an_unusable_tcp_transfer_is_a_local_prefill_with_the_same_answer(tcp_engines, damage, tmp_path):
    single, producer, _, foreign, consumer = tcp_engines
    bystander = tmp_path / "precious.kv"
    bystander.write_bytes(b"not a transfer")
    prompt = [200 + TCP_DAMAGES.index(damage)] * 3 + PROMPT[3:]
    (reference,) = single.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    source = foreign if damage == "another model" else producer
    transfer = prefill_remotely(source, prompt if damage != "another prompt" else PROMPT[::-1])
    if damage == "taken already":
        decode(consumer, [9] + prompt[1:], transfer)  # a late second fetch finds it gone
    elif damage == "producer gone":
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            transfer = {**transfer, "remote_port": probe.getsockname()[1]}
    elif damage == "malformed":
        transfer = {**transfer, "remote_port": str(transfer["remote_port"])}
    elif damage == "a path elsewhere":  # refused, and never removed: it is not the consumer's
        transfer = {**transfer, "remote_kv_path": str(bystander)}
    refused = consumer.llm_engine.kv_transfers.num_refused
    out = decode(consumer, prompt, transfer)
    assert_same_answer(out, reference)
    assert consumer.llm_engine.kv_transfers.num_refused == refused + 1
    assert out.metrics.num_cached_tokens == 0
    assert os.listdir(consumer.llm_engine.kv_transfers.folder) == []
    assert bystander.read_bytes() == b"not a transfer"
