"""The worker side of the executor seam (chapter 13): one model on one device, and how it runs a step."""

from .cuda_graphs import StepGraphs, cuda_graph_sizes, token_buckets
from .model_input import ModelInput, pack
from .model_runner import ModelRunner, forward_packed
from .worker import Worker

__all__ = ["ModelInput", "ModelRunner", "StepGraphs", "Worker", "cuda_graph_sizes", "forward_packed",
           "pack", "token_buckets"]
