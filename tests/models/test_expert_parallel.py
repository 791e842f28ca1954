"""Expert parallelism: MoE layers' experts sharded whole across the tensor-parallel ranks (worker processes over
gloo) give the single-rank tokens and logprobs bit for bit; each rank holds and loads only its experts. Without
it, tensor parallelism splits every expert's intermediate: the one-rank output (exactly, or up to the partial
sums' rounding), also on the fused path."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import torch

from helpers.engine_probe import hf_greedy_tokens_from
from helpers.tiny_models import make_tiny_hf_model
from tokenmill.cli.main import build_parser
from tokenmill.config import ModelConfig
from tokenmill.engine.llm import LLM
from tokenmill.worker.model_setup import load_model
from tokenmill.layers.moe import MoEBlock
from tokenmill.models.arch import MoEConfig
from tokenmill.models.decoder import GatedMLP
from tokenmill.models.loader import load_model_source
from tokenmill.parallel.group import TPGroup
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.worker import check_divisible

PROMPT_IDS = [[1, 5, 9, 13, 2, 7, 5, 9, 13], [3, 3, 8], list(range(20, 57)), [400, 12, 77, 5], [7, 8, 9] * 10]


def greedy(max_tokens=12):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)


def ids_and_logprobs(outputs):
    ids = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[entry[t].logprob for entry, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
    return ids, logprobs


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Mixtral (every layer MoE) and Qwen3-MoE (a dense middle layer); 8 experts, top 2; 2 KV heads."""
    return {arch: str(make_tiny_hf_model(tmp_path_factory.mktemp(arch), arch=arch))
            for arch in ("mixtral", "qwen3_moe")}


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_experts_over_2_ranks_equal_one_rank_bit_for_bit_in_bfloat16(folders, arch):
    single = ids_and_logprobs(LLM(folders[arch], dtype="bfloat16").generate(PROMPT_IDS, greedy(), use_tqdm=False))
    llm = LLM(folders[arch], dtype="bfloat16", tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        ranks = llm.llm_engine.executor.rank_descriptions
        split = ids_and_logprobs(llm.generate(PROMPT_IDS, greedy(), use_tqdm=False))
        # one request alone: steps of one token, so rank 0 owns no token in the combine
        alone = ids_and_logprobs(llm.generate([PROMPT_IDS[1]], greedy(), use_tqdm=False))
    finally:
        llm.shutdown()
    assert [("experts 0-3 of 8 on this rank" in d, "experts 4-7 of 8 on this rank" in d) for d in ranks] == \
        [(True, False), (False, True)], ranks
    assert split == single
    assert alone == ([single[0][1]], [single[1][1]])


class Exchange:
    """What threads standing in for the ranks of a group post to each other, one collective at a time."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=30)
        self.posted: list = [None] * size

    def swap(self, rank: int, item):
        self.posted[rank] = item
        self.barrier.wait()
        items = list(self.posted)
        self.barrier.wait()  # nobody posts the next collective's item before everyone has read this one
        return items


@dataclass(frozen=True)
class ThreadRank(TPGroup):
    """A rank of an expert-parallel group without torch.distributed: its collectives swap through `exchange`
    and record how many rows this rank sent."""

    exchange: Exchange = None
    sent: list = field(default_factory=list, compare=False)

    def all_to_all(self, x, send_counts, recv_counts):
        self.sent.append(sum(count for rank, count in enumerate(send_counts) if rank != self.rank))
        items = self.exchange.swap(self.rank, x.split(send_counts))
        got = [items[source][self.rank] for source in range(self.size)]
        assert [len(rows) for rows in got] == recv_counts  # what each rank expects is what it is sent
        return torch.cat(got)

    def all_gather_rows(self, x, counts):
        items = self.exchange.swap(self.rank, x)
        assert [len(rows) for rows in items] == counts
        return torch.cat(items)

    def all_reduce(self, x):
        raise AssertionError("expert parallelism combines by all-to-all, not all-reduce")


@pytest.mark.parametrize("num_tokens", [40, 3, 1])
def test_four_ranks_combine_by_all_to_all_to_the_one_rank_output_bit_for_bit(num_tokens):
    """Blocks of 4 ranks (top 3, shared experts, bfloat16), run in 4 threads: every rank ends with the one-rank
    output bit for bit, also where ranks own no tokens (3 or 1 tokens over 4 ranks), and each slot's output
    crosses between ranks at most once."""
    moe = MoEConfig(num_experts=8, top_k=3, intermediate_size=48, norm_topk_prob=False, routed_scaling_factor=2.5,
                    shared_intermediate_size=32)
    expert = lambda width: GatedMLP(64, width, "silu", TPGroup.single())  # noqa: E731
    whole = MoEBlock(moe, 64, expert, TPGroup.single())
    generator = torch.Generator().manual_seed(0)
    for param in whole.parameters():
        param.data = (torch.randn(param.shape, generator=generator) * 0.2).to(torch.bfloat16)
    x = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x[num_tokens // 2] = 0  # a token whose experts' outputs are all zeros
    exchange = Exchange(4)
    groups = [ThreadRank(rank, 4, expert_parallel=True, exchange=exchange) for rank in range(4)]
    blocks = []
    for group in groups:
        block = MoEBlock(moe, 64, expert, group)
        assert list(block.local) == list(range(2 * group.rank, 2 * group.rank + 2)) and len(block.experts) == 2
        reference = dict(whole.named_parameters())
        for name, param in block.named_parameters():
            if name.startswith("experts."):  # local index -> global
                index, rest = name[len("experts."):].split(".", 1)
                name = f"experts.{block.local.start + int(index)}.{rest}"
            param.data = reference[name].data
        blocks.append(block)

    def run(block):
        with torch.inference_mode():
            return block(x)

    with ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(run, blocks))
    with torch.inference_mode():
        expected = whole(x)
    for out in outputs:
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    assert sum(sum(g.sent) for g in groups) <= num_tokens * 3


def test_each_rank_loads_only_its_experts(folders):
    source = load_model_source(folders["qwen3_moe"], with_tokenizer=False)
    config = ModelConfig(linear_kernel="dense", attention_backend="torch_ref")
    whole, _ = load_model(source, config, torch.device("cpu"), torch.float32, 64)
    counts = {}
    for rank in range(2):
        model, _ = load_model(source, config, torch.device("cpu"), torch.float32, 64,
                              tp=TPGroup(rank, 2, expert_parallel=True))
        for layer in (0, 2):
            block, reference = model.layers[layer].mlp, whole.layers[layer].mlp
            assert isinstance(block, MoEBlock) and len(block.experts) == 4
            for index, expert in enumerate(block.experts):
                theirs = reference.experts[4 * rank + index]
                assert torch.equal(expert.gate_up_proj.weight, theirs.gate_up_proj.weight)
                assert torch.equal(expert.down_proj.weight, theirs.down_proj.weight)
            assert torch.equal(block.gate.weight, reference.gate.weight)
        counts[rank] = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
        assert model.describe_weights().endswith(f"experts {4 * rank}-{4 * rank + 3} of 8 on this rank")
    assert counts[0] == counts[1] == sum(p.numel() for n, p in whole.named_parameters() if ".experts." in n) // 2

    # the completeness check still holds for this rank's experts
    def without(name):
        return ((n, t) for n, t in source.iter_weights() if n != name)
    model, _ = load_model(source, config, torch.device("cpu"), torch.float32, 64,
                          tp=TPGroup(1, 2, expert_parallel=True))
    model.load_weights(without("model.layers.0.mlp.experts.2.up_proj.weight"))  # rank 0's: not missed
    with pytest.raises(ValueError, match=r"missing 1 tensors.*layers\.0\.mlp\.experts\.1\.gate_up_proj\.weight:1"):
        model.load_weights(without("model.layers.0.mlp.experts.5.up_proj.weight"))


def test_flag_is_in_serve_help_and_refused_where_it_does_not_apply(folders, tmp_path, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "--enable-expert-parallel" in capsys.readouterr().out
    assert build_parser().parse_args(["serve", "--enable-expert-parallel"]).enable_expert_parallel
    with pytest.raises(ValueError, match="enable_expert_parallel.*needs tensor_parallel_size > 1, got 1"):
        LLM(folders["mixtral"], enable_expert_parallel=True)
    llama = str(make_tiny_hf_model(tmp_path, arch="llama"))
    with pytest.raises(ValueError, match="enable_expert_parallel: LlamaForCausalLM has no mixture-of-experts layers"):
        LLM(llama, tensor_parallel_size=2, enable_expert_parallel=True)
    arch = load_model_source(folders["mixtral"], with_tokenizer=False).arch
    six = dataclasses.replace(arch, moe=dataclasses.replace(arch.moe, num_experts=6))
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide the model's 6 experts"):
        check_divisible(six, 4, expert_parallel=True)
    check_divisible(arch, 2, expert_parallel=True)


@dataclass(frozen=True)
class SplitRank(TPGroup):
    """A rank of a tensor-parallel group without torch.distributed, for split experts: gathers and sums swap
    through `exchange` (two ranks: a sum of two commutes, as gloo's all-reduce)."""

    exchange: Exchange = None

    def all_gather_last_dim(self, x):
        return torch.cat(self.exchange.swap(self.rank, x), dim=-1)

    def all_reduce(self, x):
        first, second = self.exchange.swap(self.rank, x)
        return first + second


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "partial_sums"])
def test_two_ranks_splitting_every_expert_give_the_one_rank_output(exact):
    """Blocks of 2 ranks (top 3, shared experts split too, float32) loaded through the layers' own loaders
    from the whole experts, run in 2 threads: exact gives the one-rank output bit for bit, partial sums
    give it up to rounding, the same on both ranks; a step of 2 tokens leaves experts without a row."""
    # widths of 64, split into 32s: PyTorch's SiLU rounds a row's tail past a multiple of 32 another way
    moe = MoEConfig(num_experts=8, top_k=3, intermediate_size=64, norm_topk_prob=False, routed_scaling_factor=2.5,
                    shared_intermediate_size=64)
    whole = MoEBlock(moe, 64, lambda width: GatedMLP(64, width, "silu", TPGroup.single()), TPGroup.single())
    generator = torch.Generator().manual_seed(0)
    for param in whole.parameters():
        param.data = torch.randn(param.shape, generator=generator) * 0.2
    exchange = Exchange(2)
    blocks = []
    for rank in range(2):
        group = SplitRank(rank, 2, exact, exchange=exchange)
        block = MoEBlock(moe, 64, lambda width, group=group: GatedMLP(64, width, "silu", group), group)
        block.gate.weight.data = whole.gate.weight.data
        for mine, theirs in zip([*block.experts, block.shared_experts], [*whole.experts, whole.shared_experts]):
            gate, up = theirs.gate_up_proj.weight.data.chunk(2)
            mine.gate_up_proj.weight_loader(mine.gate_up_proj.weight, gate, 0)
            mine.gate_up_proj.weight_loader(mine.gate_up_proj.weight, up, 1)
            mine.down_proj.weight_loader(mine.down_proj.weight, theirs.down_proj.weight.data)
        assert block.experts[0].gate_up_proj.weight.shape == (64, 64)  # half of the gate and up rows
        blocks.append(block)
    for num_tokens in (20, 2):
        x = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(num_tokens))

        def run(block):
            with torch.inference_mode():
                return block(x)

        with ThreadPoolExecutor(2) as pool:
            first, second = pool.map(run, blocks)
        with torch.inference_mode():
            expected = whole(x)
        assert torch.equal(first, second)
        if exact:
            assert torch.equal(first, expected)
        else:
            torch.testing.assert_close(first, expected, atol=1e-5, rtol=1e-5)


def test_experts_split_over_2_ranks_on_the_fused_path_give_hf_greedy_tokens(folders):
    """Worker processes over gloo, each with half of every expert's intermediate on the fused path (Triton's
    interpreter: CUDA's path); exact: the intermediate and the outputs gathered. Few tokens: interpreted."""
    from transformers import AutoModelForCausalLM

    llm = LLM(folders["mixtral"], dtype="float32", tensor_parallel_size=2, linear_kernel="triton",
              attention_backend="torch_ref", batch_invariant=False, block_size=8, num_kv_blocks=64)
    try:
        outputs = llm.generate(PROMPT_IDS[:2], greedy(4), use_tqdm=False)
    finally:
        llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(folders["mixtral"], dtype=torch.float32).eval()
    for ids, output in zip(PROMPT_IDS[:2], outputs):
        ours = output.outputs[0].token_ids
        assert ours == hf_greedy_tokens_from(hf, ids, 4, ours)
