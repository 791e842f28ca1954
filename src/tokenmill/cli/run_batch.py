"""`tokenmill run-batch -i IN.jsonl -o OUT.jsonl`: a file of OpenAI batch lines (chat completions, completions,
embeddings, Responses) run through the server's own routes in-process (server/batch_lines.py), as vLLM's run_batch.

Each input line `{"custom_id", "method": "POST", "url", "body"}` gets one output line in OpenAI's shape, written
as it finishes (so a run cut short keeps what it finished): `{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}`. A bad line (not JSON, no custom_id, a repeated custom_id, an unknown url, a
body the route refuses) gets its own output line and the others go on. `--resume` keeps the output file's lines
and runs only the lines whose custom_id it does not hold yet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from tokenmill.cli.engine_args import add_engine_args, engine_kwargs


def add_run_batch_parser(sub: argparse._SubParsersAction) -> None:
    """Register `tokenmill run-batch`."""
    p = sub.add_parser("run-batch", help="run a file of OpenAI batch lines through the engine (vLLM's run_batch)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-i", "--input-file", required=True, help="the batch lines (JSONL), one request each")
    p.add_argument("-o", "--output-file", required=True,
                   help="where each line's answer goes (JSONL, in the order they finish)")
    p.add_argument("--resume", action="store_true",
                   help="keep OUTPUT_FILE's lines and run only the input lines whose custom_id it does not hold")
    p.add_argument("--max-concurrency", type=int, default=64,
                   help="lines in the engine at once (default: 64)")
    p.add_argument("--served-model-name", default=None,
                   help="the name the lines' bodies give as model (default: the model argument)")
    add_engine_args(p)
    p.set_defaults(func=run_batch)


def read_lines(path: Path, done: set[str]) -> tuple[list, int]:
    """The input's lines to run (server/batch_lines.BatchLine, blank lines left out, repeated custom_ids refused on
    their later lines) and how many were skipped because `done` holds their custom_id."""
    from tokenmill.server.batch_lines import BatchLine, parse_line

    lines, first_seen, skipped = [], {}, 0
    with path.open(encoding="utf-8") as source:
        for number, text in enumerate(source, 1):
            if not text.strip():
                continue
            line = parse_line(number, text)
            if line.custom_id is not None and line.custom_id in done:
                skipped += 1
                continue
            if line.custom_id is not None and line.problem is None:
                if line.custom_id in first_seen:
                    line = BatchLine(number, line.custom_id, problem=f"line {number}: custom_id {line.custom_id!r} "
                                                                     f"repeats line {first_seen[line.custom_id]}'s")
                else:
                    first_seen[line.custom_id] = number
            lines.append(line)
    return lines, skipped


def finished_ids(path: Path) -> set[str]:
    """The custom_ids an earlier run's output file holds (a line cut off mid-write is ignored: it runs again)."""
    done = set()
    if path.exists():
        for text in path.read_text(encoding="utf-8").splitlines():
            try:
                custom_id = json.loads(text).get("custom_id")
            except ValueError:
                continue
            if isinstance(custom_id, str):
                done.add(custom_id)
    return done


def run_batch(args: argparse.Namespace) -> int:
    """Run the file; print the counts to stderr. Exit 0 once every line has its output line (failed lines
    included), 2 for an unusable input or engine setting."""
    from tqdm import tqdm

    from tokenmill.config import EngineConfig, ServerConfig
    from tokenmill.server.batch_lines import run_lines
    from tokenmill.server.launch import default_name, make_app

    if args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    source, target = Path(args.input_file), Path(args.output_file)
    if not source.is_file():
        raise ValueError(f"--input-file {str(source)!r} is not a file")
    done = finished_ids(target) if args.resume else set()
    lines, skipped = read_lines(source, done)
    engine_config = EngineConfig.from_kwargs(**engine_kwargs(args))
    name = args.served_model_name or default_name(engine_config.model.model)
    app, _, shutdown = make_app(engine_config, ServerConfig(served_model_name=name), name, None)
    if target.exists() and args.resume and target.stat().st_size and not target.read_bytes().endswith(b"\n"):
        with target.open("ab") as out:  # a line cut off mid-write: end it, so the next line starts on its own
            out.write(b"\n")
    try:
        with target.open("a" if args.resume else "w", encoding="utf-8") as out, \
                tqdm(total=len(lines), desc="run-batch", unit="line", file=sys.stderr) as progress:
            def write(result: dict) -> None:
                out.write(json.dumps(result) + "\n")
                out.flush()

            counts = asyncio.run(run_lines(app, lines, write, args.max_concurrency,
                                           done=lambda line, result: progress.update(1)))
    finally:
        shutdown()
    print(f"run-batch: {counts['completed']} completed, {counts['failed']} failed"
          f"{f', {skipped} already in {target}' if skipped else ''}", file=sys.stderr)
    return 0
