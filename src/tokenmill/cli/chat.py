"""`tokenmill chat`: an interactive terminal chat, streamed, against a server or in-process."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any, Callable, Iterator, Optional

from tokenmill.cli.engine_args import add_engine_args, engine_kwargs

Messages = list[dict[str, str]]
HELP = "Type a message and press Enter. /reset clears the conversation, /exit (or Ctrl-D) quits."


def add_chat_parser(sub: argparse._SubParsersAction) -> None:
    """Register `tokenmill chat`."""
    p = sub.add_parser("chat", help="interactive chat in the terminal (a server's or in-process)",
                       description="Chat with a model in the terminal, streaming each reply. With --url it "
                                   "talks to a running OpenAI-compatible server; without, it loads the "
                                   "model in-process. " + HELP)
    p.add_argument("--url", default=None, help="base URL of a running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None, help="API key for the server (sent as a Bearer token)")
    p.add_argument("--served-model", default=None, help="model name to ask the server for (default: its first)")
    p.add_argument("--system", default=None, help="system prompt that starts the conversation")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens per reply (default: 256)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default: 0.7)")
    add_engine_args(p)
    p.set_defaults(func=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    """The read-reply loop."""
    reply = _remote(args) if args.url else _in_process(args)
    history: Messages = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print(HELP, file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        text = line.strip()
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = history[:1] if args.system else []
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        answer = []
        for delta in reply(history):
            answer.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(answer)})


def _remote(args: argparse.Namespace) -> Callable[[Messages], Iterator[str]]:
    base = args.url.rstrip("/")
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    model = args.served_model

    def reply(messages: Messages) -> Iterator[str]:
        body: dict[str, Any] = {"messages": messages, "stream": True, "max_tokens": args.max_tokens,
                                "temperature": args.temperature}
        if model:
            body["model"] = model
        request = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(request) as response:
                yield from _sse_deltas(response)
        except urllib.error.HTTPError as exc:
            raise ValueError(f"server answered {exc.code}: {exc.read().decode(errors='replace')}") from None
        except urllib.error.URLError as exc:
            raise ValueError(f"cannot reach {base}: {exc.reason}") from None
    return reply


def _sse_deltas(lines: Any) -> Iterator[str]:
    for raw in lines:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        for choice in json.loads(data).get("choices", []):
            content = choice.get("delta", {}).get("content")
            if content:
                yield content


def _in_process(args: argparse.Namespace) -> Callable[[Messages], Iterator[str]]:
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs(args)))
    template: Optional[str] = engine.source.chat_template
    if not template:
        raise ValueError("this model has no chat template")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    turn = iter(range(10**9))

    def reply(messages: Messages) -> Iterator[str]:
        prompt = engine.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template,
                                                      add_generation_prompt=True)
        engine.add_request(f"chat-{next(turn)}", None, params, prompt_token_ids=engine.tokenize(prompt, False))
        shown = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                text = output.outputs[0].text
                yield text[shown:]
                shown = len(text)
    return reply
