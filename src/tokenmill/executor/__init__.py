"""Executors: where the model runs — in the engine's process, or in one worker process per rank."""

from tokenmill.executor.base import Executor, ExecutorDiedError, WorkerStepError, make_executor

__all__ = ["Executor", "ExecutorDiedError", "WorkerStepError", "make_executor"]
