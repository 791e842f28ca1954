"""`tokenmill bench serve` against a real server and `tokenmill bench throughput` in-process, as a user runs them.

`bench serve` runs as a user runs it (a `tokenmill` process, against a server process): that proves the command's
wiring, its exit status and its output. Every other case (the other subcommands, other flags, other datasets,
refusals) calls the same entry point, `main()`, in this process, which dispatches them exactly as the process
would: a process of its own would add an interpreter start and nothing that the process run does not prove."""

from __future__ import annotations

import json

import pytest
import torch

from e2e.server_harness import ServerProcess
from helpers.cli_runs import tokenmill, tokenmill_here
from helpers.tiny_models import make_tiny_hf_model
from tokenmill.kernels.cpu_kernels import cpu_kernels
from tokenmill.kernels.isa import native_bf16
from tokenmill.layers.linear_kernels import onednn_packing_available

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model", max_position_embeddings=1024))


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    proc = ServerProcess(tiny_model, "--served-model-name", "bench-test", "--num-kv-blocks", "256",
                         log_path=tmp_path_factory.mktemp("logs") / "server.log").start()
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_bench_serve_reports_exact_token_counts_latencies_memory_and_plots(server, tmp_path):
    out = tmp_path / "result.json"
    result = tokenmill("bench", "serve", "--base-url", server.url, "--model", "bench-test",
                       "--dataset", "shared-prefix", "--prefix-len", "32", "--input-len", "8", "--output-len", "5",
                       "--num-prompts", "6", "--max-concurrency", "2", "--request-rate", "50", "--seed", "7",
                       "--server-pid", str(server.proc.pid), "--plot-dir", str(tmp_path / "plots"),
                       "--goodput", "ttft:600000", "e2el:600000", "--output-json", str(out))
    assert result.returncode == 0, result.stderr
    summary = json.loads(out.read_text())
    assert summary == json.loads(result.stdout)
    assert (summary["completed"], summary["errors"]) == (6, 0)
    # greedy + ignore_eos: every request produced exactly --output-len tokens from 40-token prompts
    assert (summary["input_tokens"], summary["output_tokens"]) == (6 * 40, 6 * 5)
    assert summary["output_tokens_per_s"] == pytest.approx(30 / summary["elapsed_s"], rel=0.01)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = summary[key]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], key
    assert summary["ttft_ms"]["p50"] < summary["e2e_ms"]["p50"]
    assert 0.05 < summary["server_peak_rss_gib"] < 20
    assert len(summary["plots"]) == 2
    for path in summary["plots"]:
        assert open(path, "rb").read(8) == PNG_MAGIC
    assert "requests" in result.stderr  # the progress bar
    # SLOs of ten minutes: every request met them
    assert summary["goodput"] == {"slos_ms": {"ttft": 600000.0, "e2el": 600000.0}, "good_requests": 6,
                                  "request_goodput": pytest.approx(6 / summary["elapsed_s"], rel=0.01),
                                  "slo_attainment": 1.0}


def test_goodput_counts_only_the_requests_that_met_every_slo(server, capsys):
    result = tokenmill_here(capsys, "bench", "serve", "--base-url", server.url, "--model", "bench-test",
                            "--num-prompts", "4", "--input-len", "8", "--output-len", "4",
                            "--goodput", "ttft:0.001", "tpot:600000")
    summary = json.loads(result.stdout)
    assert (summary["completed"], summary["goodput"]["good_requests"], summary["goodput"]["slo_attainment"]) == (4, 0, 0)


def test_bench_serve_counts_errors_instead_of_stopping(server, capsys):
    result = tokenmill_here(capsys, "bench", "serve", "--base-url", server.url, "--model", "no-such-model",
                            "--num-prompts", "2", "--input-len", "4", "--output-len", "2")
    assert result.returncode == 1
    summary = json.loads(result.stdout)
    assert (summary["completed"], summary["errors"]) == (0, 2)
    assert "404" in summary["first_error"]


def test_bench_throughput_runs_the_same_datasets_in_process(tiny_model, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Tell me a story about the number {i}."})
                                 for i in range(5)) + "\n")
    for dataset, roofline in ((("--dataset", "shared-prefix", "--prefix-len", "16", "--input-len", "4"), "--roofline"),
                              (("--dataset", "jsonl", "--dataset-path", str(prompts)), "--no-roofline")):
        result = tokenmill_here(capsys, "bench", "throughput", "--model", tiny_model, "--num-kv-blocks", "256",
                                "--num-prompts", "5", "--output-len", "3", roofline, *dataset)
        assert result.returncode == 0, result.stderr
        summary = json.loads(result.stdout)
        assert (summary["completed"], summary["errors"]) == (5, 0)
        assert summary["output_tokens"] == 15
        assert summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p50"]
        assert summary["peak_rss_gib"] > 0.05
        columns = ("peak_read_gbps", "achieved_read_gbps", "peak_gflops", "achieved_gflops")
        if roofline == "--no-roofline":
            assert not set(columns) & set(summary)
            continue
        # the machine's peaks measured, and the run's decode reads and prefill arithmetic set beside them
        assert all(summary[column] > 0 for column in columns), summary
        assert summary["weight_bytes_per_step"] > 10_000


def test_bench_rejects_bad_flags_clearly(capsys):
    """In this process an exception other than the usage error would reach pytest: no traceback either way."""
    result = tokenmill_here(capsys, "bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m",
                            "--max-concurrency", "0")
    assert result.returncode == 2
    assert "--max-concurrency must be at least 1" in result.stderr and "Traceback" not in result.stderr
    for bad in ("ttft", "latency:100", "ttft:-5", "ttft:abc"):
        result = tokenmill_here(capsys, "bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m",
                                "--goodput", bad)
        assert result.returncode == 2, bad
        assert "--goodput takes NAME:MILLISECONDS" in result.stderr and repr(bad) in result.stderr


def test_bench_linears_prints_one_line_per_row_count(capsys):
    run = tokenmill_here(capsys, "bench", "linears", "--rows", "1", "20", "--layers", "1", "--repeats", "1", "--dtype", "bfloat16")
    assert run.returncode == 0, run.stderr
    title, header, *lines = run.stdout.strip().splitlines()
    kernels = cpu_kernels()
    assert title == f"{kernels.level.name} kernels, bfloat16 inputs"
    amx = kernels.amx  # the AMX columns appear where the CPU has AMX
    paths = ["dot", "amx", "dequant"] if amx else ["dot", "dequant"] if native_bf16() else ["dot"]
    # bfloat16 weights packed for oneDNN where the CPU allows it, else plain (isa.onednn_bf16_packing)
    packed = "bf16 onednn" if onednn_packing_available(torch.bfloat16, torch.device("cpu")) else "bf16 in f32"
    columns = [packed] + (["bf16 amx"] if amx else []) + [f"{f} {p}" for f in ("int8", "int4") for p in paths]
    assert header.split() == ["rows"] + " ".join(columns).split()
    assert [line.split()[0] for line in lines] == ["1", "20"]
    assert all(len(line.split()) == 1 + len(columns) and float(cell) > 0
               for line in lines for cell in line.split()[1:])


def test_bench_kv_transfer_moves_every_full_block_and_times_both_ways(tiny_model, tmp_path, capsys):
    out = tmp_path / "kv.json"
    run = tokenmill_here(capsys, "bench", "kv-transfer", "--model", tiny_model, "--block-size", "4", "--num-kv-blocks", "256",
                    "--prompt-lens", "33", "--repeats", "1", "--output-json", str(out))
    assert run.returncode == 0, run.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["prompt_tokens"] == 33
    config = json.loads(open(f"{tiny_model}/config.json").read())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim  # K and V values
    assert row["transfer_bytes"] in (32 * per_token * 2, 32 * per_token * 4)  # 8 full blocks, bf16 or float32
    assert row["transfer_ttft_ms"] == pytest.approx(row["fetch_ms"] + row["remote_ms"], abs=0.02)
    assert min(row["local_ms"], row["prefill_ms"], row["fetch_ms"], row["remote_ms"]) > 0


def test_bench_images_times_one_image_prompts_and_the_encoder(tiny_model, tmp_path, capsys):
    from helpers.tiny_models import make_tiny_qwen2_vl

    out = tmp_path / "images.json"
    model = str(make_tiny_qwen2_vl(tmp_path / "qwen2_vl"))
    run = tokenmill_here(capsys, "bench", "images", "--model", model, "--repeats", "2", "--image-size", "56", "84",
                    "--output-json", str(out))
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["image_positions"] == 6  # 56x84 pixels: 4x6 patches of 14, merged 2x2
    assert result["encoder_images"] == 2  # one per fresh image: the cached repeats hit the encoder cache
    assert min(result["processor_ms"], result["cold_ttft_ms"], result["cached_ttft_ms"], result["text_ttft_ms"],
               result["encoder_images_per_s"]) > 0
    refused = tokenmill_here(capsys, "bench", "images", "--model", tiny_model, "--repeats", "1")
    assert refused.returncode != 0 and "needs a vision-language model" in refused.stderr
