"""Executors: how the engine reaches the model (chapter 13's seam; chapter 11 adds one process per GPU)."""

from .abstract import Executor
from .multiproc_executor import MultiprocExecutor, start_tensor_parallel
from .uniproc_executor import UniprocExecutor

__all__ = ["Executor", "MultiprocExecutor", "UniprocExecutor", "start_tensor_parallel"]
