"""`tokenmill generate`: complete a prompt from the command line, streaming to stdout."""

from __future__ import annotations

import argparse
import atexit
import gc
import logging
import sys
from typing import Optional

from tokenmill.cli.bench import add_bench_parser
from tokenmill.cli.chat import add_chat_parser
from tokenmill.cli.engine_args import add_dataclass_args, add_engine_args, engine_kwargs
from tokenmill.cli.run_batch import add_run_batch_parser


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete one prompt and stream the text to stdout",
                       description="Complete PROMPT with the model and stream the text to stdout.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1)")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens, -1 = all (default: -1)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="HF-style repetition penalty")
    p.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    add_engine_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.config import EngineConfig
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.sampling_seed, stop=args.stop)
    engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs(args)))
    prompt = args.prompt
    add_special = True
    if args.chat:
        template = engine.source.chat_template
        if not template:
            raise ValueError("this model has no chat template; drop --chat")
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                      chat_template=template, add_generation_prompt=True)
        add_special = False
    engine.add_request("cli", None, params, prompt_token_ids=engine.tokenize(prompt, add_special))
    shown = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            text = output.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
    sys.stdout.write("\n")
    return 0


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    from tokenmill.config import ServerConfig
    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                       description="Serve MODEL over an OpenAI-compatible HTTP API "
                                   "(/v1/completions, /v1/chat/completions, /v1/models, /metrics, ...).")
    p.add_argument("model", nargs="?", default=None,
                   help="HF folder, .gguf file or alias (default: smollm2-135m-instruct)")
    p.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                   help="the same as MODEL, for those who spell it as vLLM's --model")
    add_dataclass_args(p, ServerConfig, "server options")
    add_engine_args(p, skip=("model",))
    p.set_defaults(func=_run_serve, log_level_default="INFO")


def _run_serve(args: argparse.Namespace) -> int:
    import dataclasses

    from tokenmill.config import EngineConfig, ServerConfig
    from tokenmill.server.launch import run_server

    args.model = serve_model(args)
    server_fields = {f.name for f in dataclasses.fields(ServerConfig)}
    server = ServerConfig(**{k: v for k, v in vars(args).items() if k in server_fields})
    engine_config = EngineConfig.from_kwargs(**engine_kwargs(args))
    if engine_config.parallel.node_rank > 0:  # another node of a multi-node run: its workers, no server
        from tokenmill.executor.nodes import run_worker_node

        return run_worker_node(engine_config)
    if server.data_parallel_size > 1:
        from tokenmill.balancer.launch import run_data_parallel

        return run_data_parallel(engine_config, server)
    return run_server(engine_config, server)


def serve_model(args: argparse.Namespace) -> Optional[str]:
    """The model `serve` was given, as MODEL or as --model (ValueError when both, differing)."""
    if args.model_option is not None and args.model is not None and args.model_option != args.model:
        raise ValueError(f"serve was given two models: {args.model!r} and --model {args.model_option!r}")
    return args.model_option if args.model_option is not None else args.model


def _env_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="print the CPU, kernel level, torch build and thread settings",
                       description="Print what tokenmill runs on here: the CPU's flags, the instruction-set "
                                   "levels it runs and the one chosen (TOKENMILL_CPU_CAPABILITY caps it), "
                                   "whether the native kernels build and load (building them if need be), "
                                   "the torch build and the thread settings.")
    p.set_defaults(func=_run_env)


def _run_env(args: argparse.Namespace) -> int:
    from tokenmill.kernels.report import environment

    rows = environment()
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def _hash_key_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("hash-key", help="print the key_hash of an API key read from stdin, for --tenants-file",
                       description="Read one API key from stdin (its first line) and print the salted hash a "
                                   "tenants file stores as key_hash: the key itself is never written down, nor "
                                   "passed on a command line. Keys shorter than 20 characters are refused: the "
                                   "hash of a short key could be searched. Example: "
                                   "`tokenmill hash-key < key.txt`.")
    p.add_argument("--new", action="store_true",
                   help="read nothing: make a new random key and print it (line 1) and its hash (line 2); give "
                        "the key to the tenant and the hash to the tenants file")
    p.set_defaults(func=_run_hash_key)


def _run_hash_key(args: argparse.Namespace) -> int:
    import secrets

    from tokenmill.server.tenants import MIN_KEY_CHARS, hash_key

    if args.new:
        key = f"tm-{secrets.token_urlsafe(32)}"
        print(key)
    else:
        key = sys.stdin.readline().strip()
        if len(key) < MIN_KEY_CHARS:
            raise ValueError(f"the key on stdin has {len(key)} characters; a key needs at least {MIN_KEY_CHARS} "
                             "(`tokenmill hash-key --new` makes one)")
    print(hash_key(key))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The full `tokenmill` argument parser."""
    parser = argparse.ArgumentParser(prog="tokenmill", description="tokenmill: LLM inference engine")
    parser.add_argument("--log-level", default=None,
                        help="logging level (default: INFO for serve, WARNING otherwise)")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _env_parser(sub)
    _hash_key_parser(sub)
    add_chat_parser(sub)
    add_bench_parser(sub)
    add_run_batch_parser(sub)
    from tokenmill.balancer.disagg_proxy import add_disagg_proxy_parser
    add_disagg_proxy_parser(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the `tokenmill` command."""
    if argv is None:  # the process's own command line, not a call from inside another program
        _freeze_the_heap_at_exit()
    args = build_parser().parse_args(argv)
    level = args.log_level or getattr(args, "log_level_default", "WARNING")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _freeze_the_heap_at_exit() -> None:
    """At interpreter exit, move every object into the collector's permanent generation (gc.freeze) first,
    unless Triton is loaded (see _freeze_heap).

    Why: after the atexit handlers, the interpreter's finalisation runs full collections over everything
    still alive; with torch, transformers and fastapi loaded that is most of a second of CPU (measured 0.8 s
    against 0.2 s frozen) in every `tokenmill serve` and other command as it exits, while the OS reclaims the
    memory anyway. Only those final collections skip what is frozen: the atexit handlers (log flushes,
    weakref finalizers such as temporary folders' cleanup) all still run before it (registered here, first,
    it runs last), and reference counting still frees objects as modules are cleared. Registered at exit
    rather than done here, and only for the process's own command line, so that `main([...])` called inside
    a longer-lived program (the tests call it) never freezes that program's heap."""
    global _FREEZE_REGISTERED
    if not _FREEZE_REGISTERED:
        atexit.register(_freeze_heap)
        _FREEZE_REGISTERED = True


_FREEZE_REGISTERED = False


def _freeze_heap() -> None:
    # Triton's nanobind extension lists at exit every instance of its types still alive; frozen, the
    # objects its compiler caches in reference cycles would be listed as leaks on every exit of a GPU server
    if "triton" not in sys.modules:
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
