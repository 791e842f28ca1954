"""How rank processes start: forked from a server process that imported their modules once.

Under spawn every rank imports torch and tokenmill again (3-5 s of CPU each, more than a small model takes
to load); a forkserver pays that once per engine process and forks each rank from it in milliseconds. Like
spawn, a rank shares nothing with the engine's process: it is forked from the server, never from the engine
(whose threads, and CUDA context on a GPU, must not be forked), and the server only imports (no thread, no
device, no cached setting is made there). The server keeps the environment and working folder of the moment
it started, so each rank takes on its engine's of the moment it is started (`Surroundings`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.context import BaseContext

from tokenmill import envs

# the modules a rank runs: imported once, in the server
PRELOADED = ["tokenmill.executor.worker_process"]


def rank_context() -> BaseContext:
    """The multiprocessing context to start rank processes in."""
    context = get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)  # read when the server starts (the first rank's start)
    return context


@dataclass(frozen=True)
class Surroundings:
    """The starting process's environment and working folder, for a rank to take on first thing."""

    environment: dict[str, str]
    folder: str

    @classmethod
    def now(cls) -> "Surroundings":
        """This process's, as they are now."""
        return cls(envs.environment(), os.getcwd())

    def enter(self) -> None:
        """Make them this process's."""
        envs.take_on(self.environment)
        os.chdir(self.folder)
