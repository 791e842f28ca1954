"""`tokenmill chat` as a user runs it: typed lines on stdin, streamed replies on stdout.

One real `tokenmill serve` (tiny random Llama, --api-key) runs for the module on 127.0.0.1; the chat
CLI's replies are checked against the server's own greedy answers for the same conversation.

Each way of chatting runs once as a `tokenmill chat` process (against the server, and with its own engine);
the further remote cases (/reset, --system, errors) call the same entry point, `main()`, in this process with the
typed lines on sys.stdin: a process of its own would add an interpreter start and nothing more.
"""

from __future__ import annotations

import io
import subprocess
import sys

import httpx
import pytest

from e2e.server_harness import ServerProcess, free_port
from helpers.tiny_models import make_tiny_hf_model
from tokenmill.cli.main import main

API_KEY = "chat-cli-key"
MAX_TOKENS = 6
PROMPT = "> "  # what input() prints before each line when stdin is not a terminal


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    process = ServerProcess(tiny_model, "--api-key", API_KEY, "--max-model-len", "512", "--num-kv-blocks", "256",
                            log_path=tmp_path_factory.mktemp("logs") / "server.log")
    try:
        yield process.start().wait_ready()
    finally:
        process.stop()


def chat(*args: str, stdin: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli.main", "chat", "--temperature", "0",
                           "--max-tokens", str(MAX_TOKENS), *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def chat_here(monkeypatch, capsys, *args: str, stdin: str) -> subprocess.CompletedProcess:
    """`chat` through the command's entry point (`sys.exit(main())`) in this process, `stdin` on sys.stdin: its
    exit status as the interpreter would set it, stdout and stderr."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    capsys.readouterr()
    try:
        status = main(["chat", "--temperature", "0", "--max-tokens", str(MAX_TOKENS), *args])
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    if isinstance(status, str):
        err, status = err + status + "\n", 1
    return subprocess.CompletedProcess(["tokenmill", "chat", *args], status or 0, out, err)


def server_reply(server: ServerProcess, messages: list[dict[str, str]]) -> str:
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_remote_chat_streams_replies_and_keeps_history(server):
    hello = [{"role": "user", "content": "Hello"}]
    first = server_reply(server, hello)
    second = server_reply(server, hello + [{"role": "assistant", "content": first},
                                           {"role": "user", "content": "How are you?"}])
    assert first and second and first != second

    result = chat("--url", server.url, "--api-key", API_KEY, stdin="Hello\nHow are you?\n/exit\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{PROMPT}{first}\n{PROMPT}{second}\n{PROMPT}"
    assert "Traceback" not in result.stderr


def test_reset_forgets_and_system_prompt_is_sent(server, monkeypatch, capsys):
    fresh = server_reply(server, [{"role": "user", "content": "Hello"}])
    result = chat_here(monkeypatch, capsys, "--url", server.url, "--api-key", API_KEY,
                       stdin="Hello\n/reset\nHello\n")  # ends with EOF
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{PROMPT}{fresh}\n{PROMPT}{PROMPT}{fresh}\n{PROMPT}"

    system = [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello"}]
    with_system = server_reply(server, system)
    assert with_system != fresh
    result = chat_here(monkeypatch, capsys, "--url", server.url, "--api-key", API_KEY, "--system", "You are a pirate.",
                       stdin="Hello\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{PROMPT}{with_system}\n{PROMPT}"


def test_remote_errors_are_one_clear_line(server, monkeypatch, capsys):
    """In this process an exception other than the clear error would reach pytest: no traceback either way."""
    no_key = chat_here(monkeypatch, capsys, "--url", server.url, stdin="Hello\n")
    assert no_key.returncode == 2
    assert "401" in no_key.stderr and "Traceback" not in no_key.stderr

    nobody = chat_here(monkeypatch, capsys, "--url", f"http://127.0.0.1:{free_port()}", stdin="Hello\n")
    assert nobody.returncode == 2
    assert "cannot reach" in nobody.stderr and "Traceback" not in nobody.stderr


def test_in_process_chat_matches_the_server(server, tiny_model):
    expected = server_reply(server, [{"role": "user", "content": "Hello"}])
    result = chat("--model", tiny_model, "--num-kv-blocks", "64", stdin="Hello\n/exit\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{PROMPT}{expected}\n{PROMPT}"
