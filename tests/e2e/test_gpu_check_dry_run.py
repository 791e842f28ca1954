"""The prepared GPU check (scripts/gpu-check.sh) runs its whole plumbing on CPU with --dry-run: a tiny
model on the Triton backend in the interpreter, HF float32 comparisons, the figures, and the served path.
On a GPU machine the same script writes the JSON the GPU issue reads; this keeps it from rotting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KEYS = ["device", "commit", "copy_bandwidth_gbs", "hf_fp32_identical", "bf16_top1_agreement", "trained_135m",
        "decode_1b_bs64_bandwidth_fraction", "decode_1b_bs1_over_floor", "ttft_1b_2048_ms",
        "graphs_speedup_135m_bs1", "vs_hf_generate_bs1", "vs_hf_generate_bs64"]


def test_the_dry_run_writes_every_figure_the_gpu_issue_reads(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--dry-run", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    assert result["errors"] == {}, result["errors"]
    missing = [key for key in KEYS if result.get(key) is None]
    assert not missing, missing
    # the Triton kernels in the interpreter give HF float32's greedy ids in every mode
    assert result["hf_fp32_identical"] == {"graphs": "8/8", "prefix_hit": "8/8", "eager": "8/8", "chunked": "8/8"}
    assert result["bf16_top1_agreement"] == 1.0  # float32 in the dry run: the two backends agree
    assert result["bf16_agreement_trained"]["triton_vs_fp32"] >= 0.99  # and HF float32 with them
    assert all(error < 1e-5 for error in result["kernel_max_abs_error"].values())
    served = result["served"]
    assert served["chat_stream_chunks"] > 0 and '"completed": 8' in served["bench_serve_table"]
    assert "| graphs_speedup_135m_bs1 |" in run.stdout
    # the profile's device-op table and the host's Python functions per step
    assert "decode_bs1_16_tokens" in (tmp_path / "profile.txt").read_text()
    host = (tmp_path / "profile-host.txt").read_text()
    assert "decode_bs1_16_tokens" in host and "function calls" in host
