"""LLM: minillm's front door, shaped like vLLM's.

    llm = LLM()                                               # the embedded SmolLM2-135M-Instruct
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=20))
    out[0].outputs[0].text
    llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(temperature=0))

Requests run through the serving engine (minillm/engine/, chapters 05-07): all of them at once, in
continuous batches over a paged KV cache. `enable_kv_cache=False` runs them one at a time with
chapter 02's full recompute at every step instead. Engine settings (EngineConfig's fields:
block_size, num_gpu_blocks, gpu_memory_utilization, enable_prefix_caching, max_num_seqs,
max_num_batched_tokens, preemption_mode, enforce_eager, ...) pass through as keyword arguments.
Everything a request carries is checked before any request runs, so one bad prompt fails fast with
a clear error.

`quantization` stores the linear layers' weights in fewer bits (chapter 08): "int8" (per output
channel), "int4" (groups of 128 inputs) or {"method": "int4", "group_size": 32 | 64 | 128}; the
options live in one dict so that methods with more of them (AWQ, GPTQ) fit the same argument.
`kv_cache_dtype="fp8"` (or "int8") stores the KV cache in one byte per number, with scales (keys per KV
head and channel, values per KV head) calibrated here on a few prompts of text: twice the tokens fit in the same memory.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

from .engine import EngineConfig, LLMEngine
from .executor import MultiprocExecutor, start_tensor_parallel
from .executor.multiproc_executor import check_tp_engine, check_tp_quantization, check_tp_size, stop_workers
from .generation import generate_sequences
from .inputs import check_length, prompt_ids
from .layers.quantization.kv_cache import calibrate_kv_scales, calibration_prompts, kv_cache_torch_dtype
from .loader import load_model
from .lora.request import LoRARequest, check_lora_request
from .outputs import RequestOutput
from .sampling import Sampler, SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _device(device) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', not {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA GPU is available; use device='cpu'")
    return dev


def _dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype in (None, "auto"):  # bf16 where matrix units have it; fp32 on a CPU
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be 'auto' or one of {', '.join(DTYPES)}, not {dtype!r}")


class LLM:
    def __init__(self, model=None, dtype="auto", device="auto", load_format: str = "auto",
                 enable_kv_cache: bool = True, quantization=None, tensor_parallel_size: int = 1, **engine_args):
        if not isinstance(enable_kv_cache, bool):
            raise TypeError(f"enable_kv_cache must be True or False, not {enable_kv_cache!r}")
        self._enable_kv_cache = enable_kv_cache
        self.device = _device(device)
        self.dtype = _dtype(dtype, self.device)
        self.tensor_parallel_size = tp = check_tp_size(tensor_parallel_size, self.device)
        if load_format == "dummy":  # refused before a (possibly huge) model is built for nothing
            raise ValueError("load_format='dummy' has no tokenizer, and LLM needs one: use LLM with real models, "
                             "and minillm.loader.load_model(name, load_format='dummy') for speed work")
        engine_config = None
        if enable_kv_cache:  # every engine argument is checked before the model loads
            try:
                engine_config = EngineConfig(**engine_args)
            except TypeError as e:
                if "unexpected keyword argument" not in str(e):
                    raise
                raise TypeError(f"unknown LLM argument: {e}") from None
        elif engine_args:
            raise ValueError(f"engine arguments {sorted(engine_args)} need enable_kv_cache=True")
        if engine_config is not None and engine_config.enable_lora and tp > 1:
            raise ValueError("enable_lora=True with tensor_parallel_size > 1 is not supported yet: use one GPU")
        procs = None
        if tp > 1:  # chapter 11: this process becomes rank 0; the other ranks load their shards meanwhile
            check_tp_engine(engine_config)
            check_tp_quantization(quantization)
            procs = start_tensor_parallel(tp, "minillm.loader:load_model", dict(
                source=model, dtype=self.dtype, load_format=load_format, quantization=quantization, tokenizer=False),
                engine_config, self.device.type)
        try:
            self._load(model, load_format, quantization, engine_config, procs)
        except BaseException:
            if procs is not None:
                for p in procs:
                    p.kill()
                stop_workers(procs)
            raise

    def _load(self, model, load_format, quantization, engine_config, procs) -> None:
        self.model, self.config, self.tokenizer = load_model(model, dtype=self.dtype, device=self.device,
                                                             load_format=load_format, quantization=quantization)
        if self.tokenizer is None:
            raise ValueError("dummy weights have no tokenizer: use LLM only with real models")
        eos = self.config.eos_token_ids or ([self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])
        self.eos_token_ids = sorted(set(eos))
        self.sampler = Sampler()
        self._ids = itertools.count()
        self.max_model_len = self.config.max_position_embeddings
        self.engine, self.shut_down = None, False
        if engine_config is not None:
            kv_dtype = kv_cache_torch_dtype(engine_config.kv_cache_dtype)
            if kv_dtype is not None:  # a quantized KV cache: its scales from text, before the engine starts
                calibrate_kv_scales(self.model, calibration_prompts(self.tokenizer), kv_dtype)
            executor = MultiprocExecutor(procs, self.model, engine_config) if procs is not None else None
            self.engine = LLMEngine(self.model, self.tokenizer, self.eos_token_ids, engine_config, executor=executor)
            self.max_model_len = self.engine.max_model_len

    def shutdown(self) -> None:
        """Let the engine's memory go (the KV pool, the CUDA graphs) and, with tensor parallelism, stop
        the other ranks' processes. The LLM cannot generate afterwards."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine, self.shut_down = None, True

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def enable_kv_cache(self) -> bool:
        """True: requests run in the engine (paged KV cache, batches); False: chapter 02's loop, one
        request at a time, recomputing the whole sequence each step. An LLM built with the cache can be
        switched to the loop and back (chapter 03 compares the two on one model); one built without has
        no engine to switch to."""
        return self._enable_kv_cache

    @enable_kv_cache.setter
    def enable_kv_cache(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"enable_kv_cache must be True or False, not {value!r}")
        if not value and self.tensor_parallel_size > 1:
            raise ValueError("enable_kv_cache=False runs the model in this process alone, and its weights are "
                             f"sharded over {self.tensor_parallel_size} ranks: keep the engine")
        if value and self.engine is None:
            raise ValueError("enable_kv_cache=True needs an engine, and this LLM was built with "
                             "enable_kv_cache=False: build LLM(enable_kv_cache=True) instead")
        self._enable_kv_cache = value

    # ---- requests -------------------------------------------------------------------------------

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """prompts: a str, a list of str, or {"prompt_token_ids": [...]} dicts (or a list of them).
        lora_request (chapter 16; LLM(..., enable_lora=True)): one adapter for every prompt, or a list
        with one per prompt (None: the base model)."""
        requests = self._prepare(prompts, sampling_params)
        loras = self._lora_requests(lora_request, len(requests))
        if not self._enable_kv_cache:
            if any(r is not None for r in loras):
                raise ValueError("lora_request needs the engine (enable_kv_cache=True, enable_lora=True)")  # chapter 02: one request at a time, recomputing everything each step
            outputs = []
            for prompt, ids, params in tqdm(requests, desc="generating", disable=not use_tqdm or len(requests) < 2):
                *_, seqs = generate_sequences(self.model, self.tokenizer, ids, params, self.eos_token_ids,
                                              self.sampler, use_kv_cache=False)
                outputs.append(RequestOutput(str(next(self._ids)), prompt, ids, [s.to_output() for s in seqs]))
            return outputs
        return self._run_engine(requests, use_tqdm, loras)

    @staticmethod
    def _lora_requests(lora_request, n: int) -> list[LoRARequest | None]:
        if isinstance(lora_request, (list, tuple)):
            if len(lora_request) != n:
                raise ValueError(f"got {len(lora_request)} lora_request for {n} prompts")
            return [check_lora_request(f"lora_request[{i}]", r) for i, r in enumerate(lora_request)]
        return [check_lora_request("lora_request", lora_request)] * n

    def _run_engine(self, requests, use_tqdm: bool, loras: list | None = None) -> list[RequestOutput]:
        """Hand every request to the engine at once and step it until all are done."""
        engine, order, done = self.engine, [], {}
        loras = loras or [None] * len(requests)
        # Every request is checked before any is queued: a refusal of the tenth leaves no other nine
        # behind in the engine.
        for i, ((_, ids, params), lora) in enumerate(zip(requests, loras)):
            engine.check_request(f"prompts[{i}]", {"prompt_token_ids": ids}, params, lora_request=lora)
        try:
            for (prompt, ids, params), lora in zip(requests, loras):
                rid = str(next(self._ids))
                engine.add_request(rid, {"prompt_token_ids": ids}, params, lora_request=lora)
                order.append((rid, prompt))
            with tqdm(total=len(order), desc="generating", disable=not use_tqdm or len(order) < 2) as bar:
                while len(done) < len(order):
                    for out in engine.step(unfinished_outputs=False):
                        if out.error is not None:  # the engine ended it; the others are aborted below
                            i = next(i for i, (rid, _) in enumerate(order) if rid == out.request_id)
                            raise RuntimeError(f"prompts[{i}] failed in the engine: {out.error}")
                        if out.finished:
                            done[out.request_id] = out
                            bar.update(1)
        finally:
            engine.abort_request([rid for rid, _ in order if rid not in done])  # e.g. after Ctrl-C
        outputs = []
        for rid, prompt in order:
            out = done[rid]
            out.prompt = prompt
            outputs.append(out)
        return outputs

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, add_generation_prompt: bool = True,
             lora_request=None):
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of them.

        Each conversation is tokenized by the chat template with its message contents as plain text
        (tokenize=True): a content that spells "<|im_end|>" cannot end its turn or forge another role's.
        RequestOutput.prompt is the rendered conversation.
        """
        if isinstance(messages, dict):
            raise TypeError("messages must be a conversation (a list of {'role', 'content'} dicts) or a list of "
                            "them, not one dict: wrap a single message in a list, [message]")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a conversation (list of {'role', 'content'} dicts) or a list of them")
        batch = all(isinstance(c, (list, tuple)) for c in messages)
        conversations = list(messages) if batch else [messages]
        texts, prompts = [], []
        for i, c in enumerate(conversations):
            try:
                texts.append(self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt))
                prompts.append({"prompt_token_ids": self.tokenizer.apply_chat_template(
                    c, add_generation_prompt=add_generation_prompt, tokenize=True)})
            except (TypeError, ValueError) as e:
                if not batch:
                    raise
                raise type(e)(f"conversation {i}: {e}") from None
        outputs = self.generate(prompts, sampling_params, use_tqdm, lora_request)
        for out, text in zip(outputs, texts):
            out.prompt = text
        return outputs

    def stream(self, prompt, sampling_params: SamplingParams | None = None,
               lora_request: LoRARequest | None = None) -> Iterator[str]:
        """Text of one completion as it is generated (n must be 1): what `minillm generate` prints."""
        [(_, ids, params)] = self._prepare([prompt], sampling_params)
        [lora] = self._lora_requests(lora_request, 1)
        if params.n != 1:
            raise ValueError(f"stream() makes one completion; n must be 1, not {params.n}")
        if not self._enable_kv_cache:
            if lora is not None:
                raise ValueError("lora_request needs the engine (enable_kv_cache=True, enable_lora=True)")
            for (seq,) in generate_sequences(self.model, self.tokenizer, ids, params, self.eos_token_ids,
                                              self.sampler, use_kv_cache=False):
                if delta := seq.stream_delta():
                    yield delta
            return
        rid = str(next(self._ids))
        self.engine.add_request(rid, {"prompt_token_ids": ids}, params, lora_request=lora)
        seq = self.engine.groups[rid].seqs[0]
        try:
            while not seq.finished:
                self.engine.step()
                if delta := seq.stream_delta():
                    yield delta
        finally:
            self.engine.abort_request(rid)  # a consumer that stops early frees the request's blocks

    # ---- checking input -------------------------------------------------------------------------

    def _prepare(self, prompts, sampling_params):
        if self.shut_down:
            raise RuntimeError("this LLM was shut down; create a new one")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a str, a {'prompt_token_ids': [...]} dict, or a non-empty list of them")
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        out = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, not {type(p).__name__}")
            text, ids = prompt_ids(self.tokenizer, self.config.vocab_size, prompt, f"prompts[{i}]")
            check_length(f"prompts[{i}]", len(ids), p, self.max_model_len)
            out.append((text, ids, p))
        return out
