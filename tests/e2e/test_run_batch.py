"""`tokenmill run-batch` (cli/run_batch.py, server/batch_lines.py) as a user runs it, through `main()` in this
process (a process of its own would add ~10 s of start-up): a 1,000-line file with 10 bad lines gives 990 answers
and 10 per-line errors in OpenAI's batch output shape, the good lines answered as the server answers them; a run
cut short and resumed with --resume runs only the lines its output file lacks. Cost: one tiny engine per run,
1,000 one-token completions (~3 s)."""

from __future__ import annotations

import json

import pytest

from helpers.agreeing_drafts import write_bigram_llama
from helpers.cli_runs import tokenmill_here


def _line(i: int) -> str:
    body = {"model": "tiny", "prompt": [5 + i % 50, 6, 7], "max_tokens": 1, "temperature": 0}
    if i % 100 == 7:  # ten bad lines: five not JSON, five with a body the route refuses
        if i % 200 == 7:
            return "{not json"
        body["max_tokens"] = 0
    return json.dumps({"custom_id": f"request-{i}", "method": "POST", "url": "/v1/completions", "body": body})


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    folder = tmp_path_factory.mktemp("batch")
    (folder / "in.jsonl").write_text("\n".join(_line(i) for i in range(1000)) + "\n")
    return folder, str(write_bigram_llama(folder / "model"))


def _run(capsys, folder, model, *extra):
    return tokenmill_here(capsys, "run-batch", "-i", str(folder / "in.jsonl"), "-o", str(folder / "out.jsonl"),
                          "--model", model, "--served-model-name", "tiny", "--num-kv-blocks", "256", *extra)


def test_a_thousand_lines_with_ten_bad_ones_and_a_resumed_run(batch, capsys):
    folder, model = batch
    result = _run(capsys, folder, model)
    assert result.returncode == 0, result.stderr
    assert "990 completed, 10 failed" in result.stderr
    out = [json.loads(text) for text in (folder / "out.jsonl").read_text().splitlines()]
    assert len(out) == 1000 and len({o["id"] for o in out}) == 1000
    answered = {o["custom_id"]: o for o in out if o["response"] and o["response"]["status_code"] == 200}
    assert len(answered) == 990
    body = answered["request-0"]["response"]["body"]
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 1
    not_json = [o for o in out if o["response"] is None]
    refused = [o for o in out if o["response"] and o["response"]["status_code"] == 400]
    assert len(not_json) == len(refused) == 5
    assert all(o["custom_id"] is None and "is not JSON" in o["error"]["message"] for o in not_json)
    assert all(o["response"]["body"]["error"]["param"] == "max_tokens" and o["error"] is None for o in refused)
    # cut short after 600 lines, the last one half written: --resume runs the 400 the file lacks (and that one)
    lines = (folder / "out.jsonl").read_text().splitlines()
    (folder / "out.jsonl").write_text("\n".join(lines[:600]) + "\n" + lines[600][:40])
    resumed = _run(capsys, folder, model, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    kept = {json.loads(text)["custom_id"] for text in lines[:600] if json.loads(text)["custom_id"]}
    assert f"already in {folder / 'out.jsonl'}" in resumed.stderr and f"{len(kept)} already" in resumed.stderr
    final = [json.loads(text) for text in (folder / "out.jsonl").read_text().splitlines()
             if text.startswith("{") and text.endswith("}")]
    ids = [o["custom_id"] for o in final if o["custom_id"] is not None]
    assert len(ids) == len(set(ids)) == 995  # every line with a custom_id once: nothing done twice
