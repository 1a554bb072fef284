"""Benchmark: multi-LoRA serving (chapter 16), minillm against HF transformers + PEFT in the same process.

    minillm bench lora [--model PATH] [--num-adapters 0 1 4 16] [--batch-sizes 1 64] [--rank 16]
                       [--prompt-len 128] [--max-tokens 128] [--repeats 3] [--json PATH]

Random PEFT adapters are made on the fly for the model (peft's own get_peft_model + save_pretrained,
random A and B: PEFT starts B at zero, which would make every adapter the base model) and saved in a
temporary folder. Per batch size B and number of distinct adapters n (request i runs adapter i % n;
n = 0: no adapter, through the LoRA-enabled engine), every figure a median over `repeats` alternating
repeats with its spread (min-max):

  ours     prefill tok/s (B prompts, one new token each: prompt tokens / wall) and decode tok/s
           (B x max_tokens, ignore EOS: the new tokens after the first / the wall time beyond the
           prefill run's), base model (no LoRA at all) vs LoRA on
  peer     HF + PEFT serving the same requests as a user would: one adapter at a time (set_adapter,
           its requests as one static batch), and, for n = 1, PEFT's merged weights (merge_and_unload:
           the single-adapter ceiling)
  ratios   ours with n adapters / ours base; ours / PEFT
  check    per adapter, our greedy tokens (all adapters in ONE batch) == PEFT's with that adapter
           alone; exact in fp32 on a CPU; in bf16 on a GPU the rounding differs, so the table says
           how many tokens agree before the first difference

Defaults follow the device: a CPU gets batch 1 and 4, 0/1/4 adapters, 16-token prompts, 8 new tokens.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ..hw import default_device
from .table import print_table

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _spread(values) -> dict:
    vals = [float(v) for v in values]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "values": vals}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_peft_adapters(hf, root: Path, n: int, rank: int, seed: int = 0, std: float = 0.02,
                       target_modules=ALL_MODULES):
    """n random adapters for `hf`, saved under root/a{i} in PEFT's format; -> (the PeftModel holding them
    all as adapters "a0".., the folders). A ~ N(0, 1/in), B ~ N(0, std^2): an update big enough to
    change greedy answers, small enough to keep the model fluent."""
    import peft

    cfg = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=list(target_modules))
    # a PeftModel already (one holding a trained adapter, say) takes the random ones beside it
    model = hf if isinstance(hf, peft.PeftModel) else peft.get_peft_model(hf, cfg, adapter_name="a0")
    folders = []
    for i in range(n):
        name = f"a{i}"
        if name not in model.peft_config:
            model.add_adapter(name, cfg)
        g = torch.Generator().manual_seed(seed * 1000 + i)
        with torch.no_grad():
            for pname, w in model.named_parameters():
                if f".{name}." in pname and "lora_A" in pname:  # [r, in]
                    w.copy_(torch.randn(w.shape, generator=g) / math.sqrt(w.shape[1]))
                elif f".{name}." in pname and "lora_B" in pname:  # [out, r]
                    w.copy_(torch.randn(w.shape, generator=g) * std)
        folder = root / name
        model.save_pretrained(str(folder), selected_adapters=[name])
        # save_pretrained puts a non-default adapter in a subfolder named after it
        folders.append(folder / name if (folder / name / "adapter_config.json").exists() else folder)
    return model.eval(), folders


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n, length), generator=g).tolist()


def _ours(llm, prompts, loras, max_tokens: int, device) -> tuple[float, float]:
    """-> (prefill seconds: one new token each; full seconds: max_tokens each)."""
    from ..sampling import SamplingParams

    reqs = [{"prompt_token_ids": p} for p in prompts]
    times = []
    for n in (1, max_tokens):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        _sync(device)
        t = time.perf_counter()
        llm.generate(reqs, params, use_tqdm=False, lora_request=loras)
        _sync(device)
        times.append(time.perf_counter() - t)
    return times[0], times[1]


@torch.inference_mode()
def _peer(peft_model, prompts, names, max_tokens: int, device) -> float:
    """PEFT unmerged, one adapter at a time: each adapter's requests as one batch (equal-length prompts:
    no padding). names[i]: request i's adapter, None for the base model. -> seconds."""
    from .hf_peer import pad_token_id

    groups: dict = {}
    for p, name in zip(prompts, names):
        groups.setdefault(name, []).append(p)
    pad = pad_token_id(peft_model)
    _sync(device)
    t = time.perf_counter()
    for name, ps in groups.items():
        ids = torch.tensor(ps, device=device)  # [b, P]
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                  min_new_tokens=max_tokens, pad_token_id=pad)
        if name is None:
            with peft_model.disable_adapter():
                peft_model.generate(**kw)
        else:
            peft_model.set_adapter(name)
            peft_model.generate(**kw)
    _sync(device)
    return time.perf_counter() - t


@torch.inference_mode()
def _hf_generate(model, prompts, max_tokens: int, device) -> float:
    from .hf_peer import pad_token_id

    ids = torch.tensor(prompts, device=device)
    _sync(device)
    t = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                   min_new_tokens=max_tokens, pad_token_id=pad_token_id(model))
    _sync(device)
    return time.perf_counter() - t


def check_rows(llm, peft_model, requests, prompts, max_tokens: int = 8) -> list[dict]:
    """Per adapter (and the base model), our greedy tokens in one mixed batch vs PEFT's alone."""
    from ..sampling import SamplingParams

    names = [None] + [r.lora_name for r in requests]
    loras = [None] + list(requests)
    batch = [prompts[i % len(prompts)] for i in range(len(names))]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                        use_tqdm=False, lora_request=loras)
    rows = []
    for name, p, o in zip(names, batch, outs):
        ids = torch.tensor([p], device=peft_model.device)
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                  min_new_tokens=max_tokens)
        with torch.inference_mode():
            if name is None:
                with peft_model.disable_adapter():
                    ref = peft_model.generate(**kw)[0, len(p):].tolist()
            else:
                peft_model.set_adapter(name)
                ref = peft_model.generate(**kw)[0, len(p):].tolist()
        ours = list(o.outputs[0].token_ids)
        agree = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
        rows.append({"adapter": name or "base", "equal": ours == ref, "agree_tokens": agree,
                     "of": max_tokens, "ours": ours, "peft": ref})
    return rows


def run(model=None, *, num_adapters=None, batch_sizes=None, rank: int = 16, prompt_len=None, max_tokens=None,
        repeats: int = 3, device=None, seed: int = 0, peer: bool = True, json_path=None,
        target_modules=ALL_MODULES, gpu_memory_utilization: float = 0.25) -> dict:
    """model: None (the embedded SmolLM2), a .gguf file or an HF folder, loaded by both sides."""
    from ..llm import LLM
    from ..lora import LoRARequest
    from ..model_files import embedded_model_path, resolve_source
    from ..notebook import describe_device, git_commit
    from .hf_peer import load_hf
    from .serving_setup import header

    device = default_device() if device is None else torch.device(device)
    gpu = device.type == "cuda"
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    num_adapters = sorted(set(num_adapters or ([0, 1, 4, 16] if gpu else [0, 1, 4])))
    batch_sizes = sorted(set(batch_sizes or ([1, 64] if gpu else [1, 4])))
    if num_adapters[0] < 0 or batch_sizes[0] < 1:
        raise ValueError(f"num_adapters must be >= 0 and batch_sizes >= 1; got {num_adapters}, {batch_sizes}")
    prompt_len = prompt_len or (128 if gpu else 16)
    max_tokens = max_tokens or (128 if gpu else 8)
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2 (decode is what follows the first token), got {max_tokens}")
    max_loras = max(1, max(num_adapters))
    source = embedded_model_path() if model is None else resolve_source(model)
    if source.is_dir() and not (source / "config.json").is_file():  # a folder holding a GGUF file
        source = sorted(source.glob("*.gguf"))[0]
    dtype = torch.bfloat16 if gpu else torch.float32
    info = header(f"lora: {source.name}; rank {rank}, adapters {num_adapters}, batch sizes {batch_sizes}, "
                  f"{prompt_len}-token prompts, {max_tokens} new tokens, {repeats} repeats")
    result = {**info, "device": describe_device(device), "commit": git_commit(), "date": time.strftime("%Y-%m-%d"),
              "model": source.name, "dtype": str(dtype).removeprefix("torch."), "rank": rank, "repeats": repeats,
              "num_adapters": num_adapters, "batch_sizes": batch_sizes, "prompt_len": prompt_len,
              "max_tokens": max_tokens}

    tmp = tempfile.TemporaryDirectory(prefix="minillm-bench-lora-")
    root = Path(tmp.name)
    hf = load_hf(source, dtype, device)
    peft_model, folders = make_peft_adapters(hf, root, max_loras, rank, seed, target_modules=target_modules)
    requests = [LoRARequest(f"a{i}", i + 1, str(f)) for i, f in enumerate(folders)]
    merged = None
    if peer and 1 in num_adapters:  # PEFT's merged weights of adapter a0: a plain HF model
        import peft

        merged = peft.PeftModel.from_pretrained(load_hf(source, dtype, device), str(folders[0])).merge_and_unload()
    kw = dict(gpu_memory_utilization=gpu_memory_utilization) if gpu else dict(device=str(device))
    kw |= dict(enable_prefix_caching=False)  # the same prompts every repeat: no cache hits
    base = LLM(str(source), **kw)
    lora = LLM(str(source), enable_lora=True, max_loras=max_loras, max_lora_rank=rank, **kw)
    if gpu:
        base.engine.warm_up(max_prompt_len=prompt_len)
        lora.engine.warm_up(max_prompt_len=prompt_len)
    vocab = hf.config.vocab_size

    result["check"] = check_rows(lora, peft_model, requests, _prompts(4, 12, vocab, seed + 1))
    print_table([{k: v for k, v in r.items() if k not in ("ours", "peft")} for r in result["check"]],
                title=f"greedy tokens, ours (one mixed batch) vs PEFT (each alone), {result['dtype']}")

    rows = []
    for B in batch_sizes:
        prompts = _prompts(B, prompt_len, vocab, seed + B)
        configs = [("base", None, None)] + [(f"lora n={n}", n, None) for n in num_adapters if n <= max(B, 1)
                                            and not (B == 1 and n > 1)]
        for label, n, _ in configs:
            loras = None if not n else [requests[i % n] for i in range(B)]
            names = [None] * B if not n else [f"a{i % n}" for i in range(B)]
            llm = base if n is None else lora
            ours_p, ours_d, ours_t, peer_t, merged_t = [], [], [], [], []
            _ours(llm, prompts[:2], None if loras is None else loras[:2], 2, device)  # warm-up
            for _ in range(repeats):  # alternating: ours, then the peer, every repeat
                tp, tf = _ours(llm, prompts, loras, max_tokens, device)
                ours_p.append(B * prompt_len / tp)
                ours_d.append(B * (max_tokens - 1) / max(tf - tp, 1e-9))
                ours_t.append(B * max_tokens / tf)
                if peer:
                    peer_t.append(B * max_tokens / _peer(peft_model, prompts, names, max_tokens, device))
                    if n == 1 and merged is not None:
                        merged_t.append(B * max_tokens / _hf_generate(merged, prompts, max_tokens, device))
            row = {"batch": B, "config": label, "distinct_adapters": n or 0, "lora": n is not None,
                   "prefill_tok_s": _spread(ours_p), "decode_tok_s": _spread(ours_d), "output_tok_s": _spread(ours_t)}
            if peer_t:
                row["peft_output_tok_s"] = _spread(peer_t)
                row["ours_vs_peft"] = _spread([a / b for a, b in zip(ours_t, peer_t)])
            if merged_t:
                row["peft_merged_output_tok_s"] = _spread(merged_t)
                row["ours_vs_peft_merged"] = _spread([a / b for a, b in zip(ours_t, merged_t)])
            rows.append(row)
        base_row = next(r for r in rows if r["batch"] == B and not r["lora"])
        for r in rows:
            if r["batch"] == B:
                for k in ("decode_tok_s", "prefill_tok_s", "output_tok_s"):
                    r[f"{k.removesuffix('_tok_s')}_vs_base"] = r[k]["median"] / base_row[k]["median"]
    result["rows"] = rows
    flat = []
    for r in rows:
        f = {"batch": r["batch"], "config": r["config"]}
        for k in ("prefill_tok_s", "decode_tok_s", "output_tok_s", "peft_output_tok_s", "peft_merged_output_tok_s",
                  "ours_vs_peft"):
            if k in r:
                f[k.removesuffix("_tok_s")] = r[k]["median"]
                f[k.removesuffix("_tok_s") + " min-max"] = f"{r[k]['min']:.3g}-{r[k]['max']:.3g}"
        f |= {"decode_vs_base": r["decode_vs_base"], "prefill_vs_base": r["prefill_vs_base"]}
        flat.append(f)
    columns = list(dict.fromkeys(k for f in flat for k in f))  # every row's fields (merged: n = 1 only)
    print_table(flat, columns, title="tok/s, median of repeats (ours: LLM.generate; peer: HF + PEFT, one adapter at a time)")
    result["summary"] = {"all_equal": all(r["equal"] for r in result["check"])}
    for llm in (base, lora):
        llm.shutdown()
    tmp.cleanup()
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))
    return result


def add_arguments(parser, name: str) -> None:
    parser.add_argument("--model", default=None, help="a .gguf file or HF folder (default: the embedded SmolLM2)")
    parser.add_argument("--num-adapters", type=int, nargs="+", default=None,
                        help="distinct adapters per batch (0: LoRA on, no adapter); default 0 1 4 16 (CPU: 0 1 4)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default 1 64 (CPU: 1 4)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-peer", dest="peer", action="store_false", help="skip HF + PEFT's timings")
    parser.add_argument("--json", dest="json_path", default=None)
