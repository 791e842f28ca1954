"""Models by Hugging Face Hub id, against a stand-in of the Hub's HTTP API on loopback (helpers/fake_hub.py):
what is downloaded, pinned revisions, GGUF files picked by quantisation, resumed downloads, offline mode,
and the errors a user meets. Each case runs in a fresh process: `huggingface_hub` reads HF_ENDPOINT,
HF_HOME and HF_HUB_OFFLINE when it is imported; the steps of one case that share those run in one process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from helpers.fake_hub import FakeHub, FakeRepo
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams

PROMPT = [1, 2, 3, 4, 5, 6, 7]
GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True)
MAIN, V1 = "a" * 40, "b" * 40

RUN = """
import json, logging, sys, types
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
import huggingface_hub.file_download
# huggingface_hub pauses a second before each retry of a broken download: a wait that proves nothing here (the
# retries and the resumed ranges are what the tests read)
huggingface_hub.file_download.time = types.SimpleNamespace(sleep=lambda seconds: None)
from tokenmill.models.loader import resolve_model_path
for kind, name, options in json.loads(sys.argv[1]):
    try:
        if kind == "resolve":
            answer = {"path": resolve_model_path(name, **options)}
        else:
            from tokenmill import LLM, SamplingParams  # the engine's imports only where it runs
            (out,) = LLM(name, **options).generate({"prompt_token_ids": %r}, SamplingParams(**%r), use_tqdm=False)
            answer = {"ids": list(out.outputs[0].token_ids)}
    except ValueError as exc:
        answer = {"error": str(exc)}
    print(json.dumps(answer), flush=True)
# as the tokenmill command does at exit (cli/main.py): the interpreter's final collections over torch's objects
# would cost most of a second of this process's exit, and the answers are already out
import gc
gc.freeze()
""" % (PROMPT, GREEDY)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")
    (path / "README.md").write_text("a model card the engine never reads")
    (path / "pytorch_model.bin").write_bytes(b"weights in a format the engine does not load")
    return path


@pytest.fixture
def hub(folder):
    hub = FakeHub({"org/tiny": FakeRepo.from_folder(folder, branches={"main": MAIN, "v1": V1}),
                   "org/gated": FakeRepo.from_folder(folder, gated=True),
                   "org/quants": FakeRepo({"tiny-Q4_K_M.gguf": b"4", "tiny-Q8_0.gguf": b"8", "config.json": b"{}"})})
    yield hub
    hub.close()


def run(hub, home, kind, name, offline=False, **options):
    """One step (`resolve` a name, or `generate` from it) in a fresh process: its answer and the process's log."""
    answers, log = run_steps(hub, home, [(kind, name, options)], offline)
    return answers[0], log


def run_steps(hub, home, steps, offline=False):
    """Steps (kind, name, options) one after the other in one fresh process started with the Hub's
    environment: their answers, in order, and the process's log."""
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HUB_OFFLINE": "1" if offline else "0"}
    env.pop("HF_TOKEN", None)
    done = subprocess.run([sys.executable, "-c", RUN, json.dumps(steps)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    answers = [json.loads(line) for line in done.stdout.strip().splitlines()[-len(steps):]]
    assert len(answers) == len(steps), done.stdout[-3000:]
    return answers, done.stderr


def test_a_hub_id_downloads_only_what_the_engine_reads_and_answers_as_the_local_folder(hub, folder, tmp_path):
    (reference,) = LLM(str(folder)).generate({"prompt_token_ids": PROMPT}, SamplingParams(**GREEDY), use_tqdm=False)
    (answer, cached), log = run_steps(hub, tmp_path, [("generate", "org/tiny", {}), ("resolve", "org/tiny", {})])
    assert answer == {"ids": list(reference.outputs[0].token_ids)}
    fetched = {r.split("/")[-1] for r in hub.requests if r.startswith("GET /org/tiny/resolve/")}
    assert fetched == {p.name for p in folder.iterdir()} - {"README.md", "pytorch_model.bin"}
    assert f"model org/tiny is commit {MAIN}" in log
    assert cached["path"].endswith(f"snapshots/{MAIN}")  # the folder the engine just answered from
    # from the cache, without the network (unreachable, and in offline mode): the same folder, so the same answer
    # (resolved only: the engine would load the very files it loaded above)
    hub.close()
    assert run(hub, tmp_path, "resolve", "org/tiny")[0] == cached
    assert run(hub, tmp_path, "resolve", "org/tiny", offline=True)[0] == cached


def test_a_pinned_revision_resolves_to_its_commit(hub, tmp_path):
    (answer, missing), log = run_steps(hub, tmp_path, [("resolve", "org/tiny", dict(revision="v1")),
                                                       ("resolve", "org/tiny", dict(revision="v2"))])
    assert answer["path"].endswith(f"snapshots/{V1}")
    assert f"model org/tiny revision v1 is commit {V1}" in log
    assert missing == {"error": "model 'org/tiny' has no revision 'v2' on the Hub"}


def test_download_dir_takes_the_place_of_the_cache(hub, tmp_path):
    path = run(hub, tmp_path / "home", "resolve", "org/tiny", download_dir=str(tmp_path / "models"))[0]["path"]
    assert path.startswith(str(tmp_path / "models")) and os.path.isfile(os.path.join(path, "config.json"))
    assert not (tmp_path / "home" / "hub" / "models--org--tiny").exists()


def test_a_gguf_file_is_picked_by_its_quantisation(hub, tmp_path):
    (q8, q4, q5), _ = run_steps(hub, tmp_path, [("resolve", "org/quants:q8_0", {}),
                                                ("resolve", "org/quants", dict(gguf_file="tiny-Q4_K_M.gguf")),
                                                ("resolve", "org/quants:Q5_K_M", {})])
    assert q8["path"].endswith("tiny-Q8_0.gguf") and open(q8["path"], "rb").read() == b"8"
    assert q4["path"].endswith("Q4_K_M.gguf")
    assert "no GGUF file for 'Q5_K_M'" in q5["error"] and "tiny-Q4_K_M.gguf" in q5["error"]


def test_what_cannot_be_had_is_a_clear_error(hub, tmp_path):
    (missing, gated), _ = run_steps(hub, tmp_path, [("generate", "org/missing", {}), ("generate", "org/gated", {})])
    assert missing["error"].startswith("model 'org/missing' was not found on the Hub")
    assert gated["error"].startswith(
        "model 'org/gated' is gated on the Hub: accept its terms on its page, then give a token")
    offline, _ = run(hub, tmp_path, "generate", "org/tiny", offline=True)
    assert offline["error"].startswith("model org/tiny is not in the local cache and HF_HUB_OFFLINE is set")


def test_an_interrupted_download_resumes_and_never_leaves_half_a_model(hub, folder, tmp_path):
    weights = (folder / "model.safetensors").read_bytes()
    cut = len(weights) * 2 // 3  # past huggingface_hub's first 10 MB chunk, the unit it resumes after
    hub.cut_after["model.safetensors"] = (1000, 100)  # every try breaks off before a chunk arrives
    assert "could not be downloaded" in run(hub, tmp_path, "resolve", "org/tiny")[0]["error"]
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / MAIN
    assert not (snapshot / "model.safetensors").exists()  # never a half-written model
    hub.cut_after["model.safetensors"] = (cut, 1)  # one connection breaks off
    hub.requests.clear()
    path = run(hub, tmp_path, "resolve", "org/tiny")[0]["path"]
    assert (open(os.path.join(path, "model.safetensors"), "rb").read()) == weights
    gets = [r for r in hub.requests if r.startswith("GET /org/tiny/resolve/") and "model.safetensors" in r]
    resumed = re.search(r"bytes=(\d+)-$", gets[-1])  # the second request resumed from what had arrived
    assert len(gets) == 2 and resumed and 0 < int(resumed.group(1)) <= cut


def test_tokenmill_serve_takes_a_hub_id_and_serves_it_under_that_name(hub, tmp_path):
    # a server process of its own: what it proves is that `serve` resolves the id when it starts
    from e2e.server_harness import ServerProcess

    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path), "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "0"}
    server = ServerProcess("org/tiny", "--revision", "v1", "--num-kv-blocks", "64", log_path=tmp_path / "server.log",
                           env=env).start()
    try:
        server.wait_ready()
        import httpx

        assert [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]] == ["org/tiny"]
        answer = httpx.post(f"{server.url}/v1/completions", timeout=60,
                            json={"model": "org/tiny", "prompt": "hello", "max_tokens": 3}).json()
        assert answer["choices"][0]["text"]
    finally:
        server.stop()
    assert f"model org/tiny revision v1 is commit {V1}" in server.log()
