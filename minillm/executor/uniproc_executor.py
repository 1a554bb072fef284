"""UniprocExecutor: one Worker in the engine's own process (chapter 13; vLLM's name).

Every call is a method call on the worker, so nothing is copied and a step costs what it cost before
the seam existed. It also builds chapter 09's proposer, which drafts with the worker's model and cache.
"""

from __future__ import annotations

from ..spec_decode import make_proposer
from ..worker.model_input import ModelInput, ModelRunnerOutput
from ..worker.worker import Worker
from .abstract import Executor


class UniprocExecutor(Executor):
    def __init__(self, model, config, draft_model=None):
        self.config, self.draft_model = config, draft_model
        self.worker = Worker(model, config, draft_model)
        self.sizes = self.worker.sizes

    def determine_num_blocks(self) -> tuple[int, int]:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, progress: bool = True) -> None:
        worker = self.worker
        worker.initialize_cache(num_gpu_blocks, num_cpu_blocks, progress)
        self.sizes = worker.sizes
        spec = self.config.speculative_config
        if spec is not None:
            proposer = make_proposer(spec, worker.model, worker.runner, worker.sizes, self.draft_model)
            worker.attach_proposer(proposer, progress)

    def execute_model(self, model_input: ModelInput) -> ModelRunnerOutput:
        return self.worker.execute_model(model_input)

    def sample_tokens(self, bitmask) -> ModelRunnerOutput:
        return self.worker.sample_tokens(bitmask)

    def swap_and_copy(self, swap_out, swap_in, copies, offload_save=(), offload_load=()) -> None:
        self.worker.swap_and_copy(swap_out, swap_in, copies, offload_save, offload_load)

    def propose(self, seqs, num_spec, table_changes):
        return self.worker.propose(seqs, num_spec, table_changes)

    def capture_token_buckets(self) -> None:
        self.worker.capture_token_buckets(self.sizes.max_model_len)

    def shutdown(self) -> None:
        self.worker.shutdown()

    # the one worker's parts, for tests, benchmarks and notebooks that look inside (uniproc only)
    @property
    def runner(self):
        return self.worker.runner

    @property
    def cache(self):
        return self.worker.cache

    @property
    def proposer(self):
        return self.worker.proposer
