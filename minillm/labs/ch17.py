"""Checks for lab 17: the router's two-phase request, over two engines that share a KV connector.

The student writes `two_phase(producer, consumer, request_id, prompt_ids, params)`: what
minillm/entrypoints/router.py does over HTTP, done on two LLMEngines in this process. Phase 1 runs the
prompt on the producer with one token to generate and the handle {"do_remote_decode": true,
"transfer_id": ID}; phase 2 runs the request itself on the consumer with {"do_remote_prefill": true,
"transfer_id": ID}; the consumer's token ids are the answer.

The check builds a colocated engine, a producer and a consumer (a tiny Llama with dummy weights, fp32 on
the CPU, SharedStorageConnector in a fresh folder) and runs fresh random prompts (some sharing a prefix)
through the student's function and through the colocated engine. It fails if the tokens differ, if the
consumer computed more than each prompt's last token (the K/V did not come from the producer: a
"two-phase" that just runs the request on the consumer), or if the producer generated more than one
token per request.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import tempfile

from ..engine import EngineConfig, LLMEngine
from ..sampling import SamplingParams
from .checker import CheckFailed, Verdict
from .hints import Hints


def finish(engine: LLMEngine, request_id: str, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    """Add one request, step the engine until it has finished; -> its token ids (a failed request raises)."""
    engine.add_request(request_id, {"prompt_token_ids": list(prompt_ids)}, params)
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                if out.error:
                    raise RuntimeError(f"request {request_id} failed on the engine: {out.error}")
                return list(out.outputs[0].token_ids)


def with_handle(params: SamplingParams, handle: dict, **changes) -> SamplingParams:
    extra = {**(params.extra_args or {}), "kv_transfer_params": handle}
    return dataclasses.replace(params, extra_args=extra, **changes)


def two_phase_reference(producer, consumer, request_id, prompt_ids, params) -> list[int]:
    tid = f"lab-{request_id}"
    finish(producer, request_id, prompt_ids, with_handle(params, {"do_remote_decode": True, "transfer_id": tid},
                                                         max_tokens=1))
    return finish(consumer, request_id, prompt_ids, with_handle(params, {"do_remote_prefill": True,
                                                                         "transfer_id": tid}))


def _engines(folder: str):
    from ..bench.disagg import tiny_config
    from ..loader import load_model
    from ..tokenizer import train_bpe
    from ..tokenizer.samples import FIXED

    model, _, _ = load_model(tiny_config(), load_format="dummy", device="cpu")
    tok = train_bpe("\n".join(FIXED), vocab_size=300)
    common = dict(block_size=4, num_gpu_blocks=256, max_num_batched_tokens=64)
    kv = {"kv_connector": "SharedStorageConnector", "kv_path": folder, "kv_load_timeout": 2.0}

    def engine(role=None):
        config = EngineConfig(**common, kv_transfer_config={**kv, "kv_role": role} if role else None)
        return LLMEngine(copy.deepcopy(model), tok, [], config, progress=False)

    return engine(), engine("producer"), engine("consumer")


def check_two_phase(two_phase, cases: int = 6, seed: int | None = None) -> Verdict:
    name = "two_phase"
    if not callable(two_phase):
        raise TypeError(f"{name}: pass your function itself, not {type(two_phase).__name__}")
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as folder:
        colocated, producer, consumer = _engines(folder)
        system = [rng.randrange(512) for _ in range(rng.randrange(6, 20))]
        for i in range(cases):
            prompt = (system if rng.random() < 0.5 else []) + [rng.randrange(512) for _ in range(rng.randrange(2, 16))]
            params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(2, 8), ignore_eos=True)
            want = finish(colocated, f"c{i}", prompt, params)
            before_c = consumer.engine_stats.num_prompt_tokens
            before_p = producer.engine_stats.num_generation_tokens
            got = two_phase(producer, consumer, f"r{i}", prompt, params)
            where = f"case {i + 1} of {cases} (seed {seed}), a prompt of {len(prompt)} tokens"
            if got != want:
                raise CheckFailed(f"❌ {name}: {where}: the consumer answered {got}, the colocated engine {want}")
            if (n := consumer.engine_stats.num_prompt_tokens - before_c) != 1:
                raise CheckFailed(f"❌ {name}: {where}: the consumer computed {n} prompt tokens; with the producer's "
                                  "K/V it computes only the last one (did phase 2 carry do_remote_prefill and the "
                                  "transfer id of phase 1?)")
            if (n := producer.engine_stats.num_generation_tokens - before_p) != 1:
                raise CheckFailed(f"❌ {name}: {where}: the producer generated {n} tokens; phase 1 asks for one "
                                  "(max_tokens=1): the rest is the consumer's work")
    print(f"✅ {name}: {cases} random requests, two-phase tokens equal the colocated engine's, the consumer "
          "computed one prompt token each")
    return Verdict(name, "passed", cases)


hint = Hints("17", {
    "two_phase": (
        "Two calls to `ch17.finish`: first on the producer, then on the consumer, with the same prompt. What "
        "differs between them is the SamplingParams: the handle in extra_args, and how many tokens to generate.",
        "Both phases name one transfer: make an id from request_id. Phase 1: params with max_tokens=1 and "
        "extra_args={'kv_transfer_params': {'do_remote_decode': True, 'transfer_id': tid}}. Phase 2: the "
        "client's params with {'do_remote_prefill': True, 'transfer_id': tid}. Return phase 2's tokens.",
        "tid = f'lab-{request_id}'\n"
        "p1 = dataclasses.replace(params, max_tokens=1, extra_args={'kv_transfer_params': "
        "{'do_remote_decode': True, 'transfer_id': tid}})\n"
        "ch17.finish(producer, request_id, prompt_ids, p1)\n"
        "p2 = dataclasses.replace(params, extra_args={'kv_transfer_params': {'do_remote_prefill': True, "
        "'transfer_id': tid}})\n"
        "return ch17.finish(consumer, request_id, prompt_ids, p2)"),
})
