"""`tokenmill generate` as a user runs it.

`generate` and `serve` run as `tokenmill` processes; the help and the usage errors call the same entry point,
`main()`, in this process: a process of its own would add an interpreter start and nothing more."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from helpers.cli_runs import tokenmill, tokenmill_here
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.config import SECTIONS
from tokenmill.models.loader.tokenizer import load_hf_tokenizer


def test_help_explains_every_engine_flag(capsys):
    result = tokenmill_here(capsys, "generate", "--help")
    assert result.returncode == 0
    for klass in SECTIONS.values():
        for f in dataclasses.fields(klass):
            assert "--" + f.name.replace("_", "-") in result.stdout
            assert f.metadata["help"].split()[0] in result.stdout


def test_generate_streams_the_greedy_completion(tmp_path):
    path = str(make_tiny_hf_model(tmp_path, arch="llama"))
    result = tokenmill("generate", "Hello there", "--model", path, "--max-tokens", "8", "--num-kv-blocks", "64")
    assert result.returncode == 0, result.stderr
    expected = LLM(path, num_kv_blocks=64).generate("Hello there", SamplingParams(temperature=0, max_tokens=8))
    assert result.stdout == expected[0].outputs[0].text + "\n"


def test_missing_model_path_is_a_clear_error(tmp_path, capsys):
    """In this process an exception other than the clear error would reach pytest: no traceback either way."""
    result = tokenmill_here(capsys, "generate", "hi", "--model", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert "nope" in result.stderr and "Traceback" not in result.stderr


def test_serve_takes_the_model_as_vllm_does_positional_or_flag(tmp_path, capsys):
    from tokenmill.cli.main import build_parser, serve_model

    parser = build_parser()
    assert serve_model(parser.parse_args(["serve", "gemma3-270m"])) == "gemma3-270m"
    assert serve_model(parser.parse_args(["serve", "--model", "gemma3-270m"])) == "gemma3-270m"
    assert serve_model(parser.parse_args(["serve"])) is None  # the default model
    result = tokenmill_here(capsys, "serve", "one", "--model", "two")
    assert result.returncode == 2
    assert "serve was given two models: 'one' and --model 'two'" in result.stderr and "Traceback" not in result.stderr
    # a process: a server that wrongly started would not return here
    result = tokenmill("serve", "--model", str(tmp_path / "nope"), "--port", "0")
    assert result.returncode == 2 and "nope" in result.stderr  # the flag reaches the loader


def test_a_cpu_run_never_imports_triton_or_initialises_cuda_or_imports_transformers_models(tmp_path):
    # the GPU path imports lazily: a CPU-only install starts and generates without Triton or CUDA. And once a
    # folder's tokenizer class is remembered (this process's load records it), a process loads that tokenizer
    # without importing transformers.models, whose package scans every model's sources (a second of CPU)
    path = str(make_tiny_hf_model(tmp_path, arch="llama"))
    load_hf_tokenizer(path)
    probe = ("import sys, torch; from tokenmill import LLM, SamplingParams; "
             f"llm = LLM({path!r}, num_kv_blocks=64, device='cpu'); "
             "llm.chat([{'role': 'user', 'content': 'Hi'}], SamplingParams(max_tokens=4), use_tqdm=False); "
             "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.')), "
             "torch.cuda.is_initialized(), 'transformers.models' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[] False False"


def test_batch_invariant_flag_is_unset_on_or_off():
    from tokenmill.cli.main import build_parser

    parser = build_parser()
    base = ["generate", "hi"]
    assert parser.parse_args(base).batch_invariant is None  # on for CPU, off on CUDA (config.py)
    assert parser.parse_args([*base, "--batch-invariant"]).batch_invariant is True
    assert parser.parse_args([*base, "--no-batch-invariant"]).batch_invariant is False
    assert parser.parse_args([*base, "--enforce-eager"]).enforce_eager is True
    assert parser.parse_args([*base, "--gpu-memory-utilization", "0.5"]).gpu_memory_utilization == 0.5
