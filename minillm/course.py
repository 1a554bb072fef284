"""The course map as data: per chapter its text, notebook, lab and the module files it builds.

The module files are what a chapter's notebook measures. Their hash, printed in the notebook's first
output (`minillm.notebook.header`), is what `minillm labs stale` compares with the files of today:
a notebook whose chapter's modules changed after its run is listed as stale, and the course map
(README and the site's home page) says so per chapter.

A path ending in "/" is every `*.py` file under it. Paths starting with `kernels/` are the Triton
kernels, installed as `minillm.kernels`; the rest are paths of the `minillm` package.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Chapter:
    number: str  # "09"
    title: str
    text: str  # chapters/<text>
    notebook: str  # notebooks/<notebook>.ipynb ("" while it has none)
    lab: str  # notebooks/labs/<lab>.ipynb
    modules: tuple[str, ...]


CHAPTERS: tuple[Chapter, ...] = (
    Chapter("00", "Why inference is different", "00-why-inference-is-different.md", "00_why_inference_is_different",
            "00_arithmetic_of_inference", ("minillm/hw.py", "minillm/kv_memory.py", "minillm/bench/ceilings.py")),
    Chapter("01", "The tokenizer", "01-tokenizer.md", "01_tokenizer", "01_bpe",
            ("minillm/tokenizer/", "minillm/bench/tokenizer.py")),
    Chapter("02", "The model", "02-the-model.md", "02_model", "02_model",
            ("minillm/models/llama.py", "minillm/models/registry.py", "minillm/layers/activation.py",
             "minillm/layers/attention.py", "minillm/layers/layernorm.py", "minillm/layers/linear.py",
             "minillm/layers/rotary_embedding.py", "minillm/layers/vocab_parallel_embedding.py", "minillm/loader/",
             "minillm/sampling/sampler.py", "minillm/sampling/sampling_params.py", "minillm/sampling/rng.py",
             "minillm/llm.py")),
    Chapter("03", "The KV cache", "03-kv-cache.md", "03_kv_cache", "03_kv_cache",
            ("minillm/cache/kv_cache.py", "minillm/generation.py")),
    Chapter("04", "FlashAttention in Triton", "04-flash-attention.md", "04_flash_attention", "04_flash_attention",
            ("kernels/flash_attn.py", "kernels/flash_decode.py", "kernels/attention_ref.py", "kernels/rms_norm.py",
             "kernels/rotary.py", "kernels/activation.py", "minillm/layers/backend.py", "minillm/bench/attention.py")),
    Chapter("05", "Paged KV blocks", "05-paged-kv.md", "05_paged_kv", "05_paged_kv",
            ("minillm/cache/paged.py", "minillm/engine/block_manager.py", "kernels/store_kv.py")),
    Chapter("06", "Prefix caching", "06-prefix-caching.md", "06_prefix_caching", "06_prefix_cache",
            ("minillm/engine/prefix_cache.py",)),
    Chapter("07", "Continuous batching", "07-continuous-batching.md", "07_continuous_batching", "07_scheduler",
            ("minillm/engine/scheduler.py", "minillm/engine/llm_engine.py", "minillm/worker/model_runner.py",
             "minillm/engine/config.py", "minillm/worker/cuda_graphs.py", "minillm/worker/model_input.py", "minillm/engine/step_input.py",
             "minillm/bench/serving.py")),
    Chapter("08", "Quantization", "08-quantization.md", "08_quantization", "08_quantization",
            ("minillm/layers/quantization/", "kernels/w4a16.py", "kernels/w4a16_gemv.py", "kernels/w4a16_swap.py",
             "kernels/wna16_dequant.py", "kernels/quant_fp8.py", "kernels/w8a16_fp8.py",
             "minillm/eval/", "minillm/data/")),
    Chapter("09", "Speculative decoding", "09-speculative-decoding.md", "09_speculative_decoding",
            "09_speculative_decoding",
            ("minillm/spec_decode/", "minillm/sampling/rejection_sampler.py", "minillm/engine/spec_decode_steps.py",
             "minillm/bench/spec.py")),
    Chapter("10", "MLA and MoE", "10-mla-and-moe.md", "10_mla_moe", "10_mla_moe",
            ("minillm/layers/mla.py", "minillm/layers/moe.py", "kernels/mla_decode.py", "kernels/fused_moe.py",
             *(f"kernels/moe_configs/E={e},N={n},device_name={gpu},dtype=bfloat16.json"  # the tuned tiles
               for e, n in ((64, 1408), (128, 768)) for gpu in ("NVIDIA_H100_80GB_HBM3", "NVIDIA_H200")),
             "minillm/models/mixtral.py", "minillm/models/qwen3_moe.py", "minillm/models/deepseek_v2.py",
             "minillm/bench/moe.py")),
    Chapter("11", "Tensor parallelism", "11-tensor-parallelism.md", "11_tensor_parallelism", "11_tensor_parallelism",
            ("minillm/distributed/", "minillm/layers/linear.py", "minillm/layers/vocab_parallel_embedding.py",
             "minillm/executor/multiproc_executor.py", "minillm/worker/worker_proc.py")),
    Chapter("12", "Serving", "12-serving.md", "12_serving", "12_serving",
            ("minillm/engine/async_llm_engine.py", "minillm/engine/core_client.py", "minillm/engine/core_process.py",
             "minillm/engine/engine_core.py", "minillm/entrypoints/openai/", "minillm/bench/serve.py",
             "minillm/bench/serve_metrics.py", "minillm/bench/serve_overhead.py")),
    Chapter("13", "The fast path", "13-the-fast-path.md", "13_fast_path", "13_fast_path",
            ("minillm/executor/", "minillm/worker/", "minillm/engine/overlap_steps.py",
             "minillm/sampling/device_sampler.py", "minillm/bench/profile.py", "minillm/bench/step_profile.py")),
    Chapter("14", "Structured output", "14-structured-output.md", "14_structured_output", "14_structured_output",
            ("minillm/structured_output/", "minillm/engine/structured_output.py", "minillm/sampling/token_mask.py",
             "kernels/token_bitmask.py", "minillm/bench/structured.py", "minillm/bench/structured_cases.py")),
    Chapter("15", "KV eviction and offload", "15-kv-eviction-and-offload.md", "15_kv_eviction", "15_kv_eviction",
            ("minillm/engine/kv_eviction.py", "minillm/worker/kv_compaction.py", "kernels/attn_mass.py",
             "minillm/bench/kv.py")),
    Chapter("16", "Multi-LoRA serving", "16-multi-lora.md", "16_multi_lora", "16_multi_lora",
            ("minillm/lora/", "kernels/lora_bgmv.py", "minillm/bench/lora.py")),
    Chapter("17", "Disaggregated prefill and decode", "17-disaggregated-prefill-decode.md", "17_disaggregation",
            "17_disaggregation",
            ("minillm/distributed/kv_transfer/", "kernels/kv_block_copy.py", "minillm/entrypoints/router.py",
             "minillm/bench/disagg.py")),
    Chapter("18", "Decode at the bandwidth floor", "18-decode-at-the-floor.md", "18_decode_floor", "18_decode_floor",
            ("kernels/gemv.py", "minillm/layers/decode_gemv.py", "kernels/rope_store_kv.py", "kernels/flash_decode.py",
             "minillm/models/llama.py")),
)


def chapter(number: str) -> Chapter:
    for c in CHAPTERS:
        if c.number == number:
            return c
    raise ValueError(f"no chapter {number!r}; the chapters are {[c.number for c in CHAPTERS]}")


def installed_roots() -> dict[str, Path]:
    """Where the `minillm/` and `kernels/` paths of a module list live in the installed package (the
    notebook's view: a GPU machine may run an installed copy, not a checkout)."""
    pkg = Path(importlib.util.find_spec("minillm").submodule_search_locations[0])
    kernels = Path(importlib.util.find_spec("minillm.kernels").submodule_search_locations[0])
    return {"minillm/": pkg, "kernels/": kernels}


def repo_roots(repo: Path) -> dict[str, Path]:
    """The same paths in a checkout of the repository."""
    return {"minillm/": repo / "minillm", "kernels/": repo / "kernels"}


def module_files(c: Chapter, roots: dict[str, Path]) -> dict[str, Path]:
    """{repository path: file} of every module file of chapter c, sorted by path."""
    files = {}
    for entry in c.modules:
        prefix = next(p for p in roots if entry.startswith(p))
        path = roots[prefix] / entry[len(prefix):]
        if entry.endswith("/"):
            for f in path.rglob("*.py"):
                files[prefix + f.relative_to(roots[prefix]).as_posix()] = f
        elif path.is_file():
            files[entry] = path
        else:
            raise FileNotFoundError(f"chapter {c.number}'s module {entry} is not at {path}")
    return dict(sorted(files.items()))


def modules_hash(c: Chapter, roots: dict[str, Path] | None = None) -> str:
    """12 hex digits of a SHA-256 over (path, content) of the chapter's module files: equal exactly when
    the files are equal, whether read from a checkout or from an installed copy."""
    h = hashlib.sha256()
    for rel, f in module_files(c, roots or installed_roots()).items():
        h.update(rel.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:12]
