"""Run the `tokenmill` command as a user does (its own process) or through its entry point in the test process."""

from __future__ import annotations

import subprocess
import sys

from tokenmill.cli.main import main


def tokenmill(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`tokenmill ARGS` in its own process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "tokenmill.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def tokenmill_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """`tokenmill ARGS` through the command's entry point (`sys.exit(main())`) in this process: its exit status
    as the interpreter would set it (a SystemExit message goes to stderr with status 1), stdout and stderr."""
    capsys.readouterr()
    try:
        status = main(list(args))
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    if isinstance(status, str):
        err, status = err + status + "\n", 1
    return subprocess.CompletedProcess(["tokenmill", *args], status or 0, out, err)
