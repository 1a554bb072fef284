"""The serving benchmarks' peer: Hugging Face transformers `generate`, run in the same process.

Two ways of serving the same requests that minillm's engine gets (minillm/bench/serving.py):

  static batching  requests cut in order into batches of `batch_size`, each left-padded to its
                   longest prompt and run until its longest output is done (`min_new_tokens` =
                   `max_new_tokens`, so EOS cannot end a batch early). A short request's slot
                   keeps computing after its own output is done: only each request's own tokens
                   count as useful, the rest is the waste continuous batching (chapter 07) removes.
  batch 1          one prompt, with a streamer that notes when each token reaches the host, so
                   TTFT and the gaps between tokens are measured the way the engine measures them
                   (after the token's device-to-host copy).

The HF model is the one minillm runs: the same GGUF file (transformers dequantizes it), the same
HF folder, or, for dummy weights, the same shapes with HF's own random init (speed only).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..config import ModelConfig

_HF_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def hf_config(cfg: ModelConfig):
    """A transformers config with minillm's ModelConfig's shapes (for HF models with random weights)."""
    import transformers

    windows = {w for w in cfg.sliding_windows if w is not None}
    if windows and (cfg.architecture != "mistral" or len(windows) > 1 or None in cfg.sliding_windows):
        raise ValueError("hf_config handles sliding windows only as Mistral's one window on every layer")
    fields = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                  max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
                  rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings)
    if cfg.rope_scaling:
        fields["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.architecture == "llama":
        fields.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    if cfg.architecture == "mistral":
        fields["sliding_window"] = windows.pop() if windows else None
    if cfg.architecture == "qwen3":
        fields["attention_bias"] = cfg.qkv_bias
    return getattr(transformers, _HF_CLASSES[cfg.architecture])(**fields)


def load_hf(source: str | Path | ModelConfig, dtype: torch.dtype, device: torch.device):
    """The peer model: from a ModelConfig (random init), a .gguf file, or an HF folder."""
    import transformers

    transformers.logging.set_verbosity_error()  # greedy-with-sampling-defaults warnings, GGUF notes
    auto = transformers.AutoModelForCausalLM
    if isinstance(source, ModelConfig):
        with torch.device(device):  # initialised where it runs: no large CPU init then copy
            model = auto.from_config(hf_config(source), dtype=dtype)
    else:
        path = Path(source)
        if path.suffix == ".gguf":
            model = auto.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        else:
            model = auto.from_pretrained(str(path), dtype=dtype)
    return model.to(device).eval()


def pad_token_id(hf) -> int:
    """Any id works as padding (the attention mask hides it); the config's if it names one."""
    cfg = hf.generation_config
    for cand in (cfg.pad_token_id, cfg.eos_token_id, 0):
        if isinstance(cand, list):
            cand = cand[0] if cand else None
        if cand is not None:
            return int(cand)
    return 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def static_batches(hf, requests: list[tuple[list[int], int]], batch_size: int, device: torch.device,
                   progress: bool = True, desc: str | None = None) -> dict:
    """Serve (prompt ids, output length) requests in order, `batch_size` at a time; wall time and token counts."""
    from tqdm.auto import tqdm

    pad = pad_token_id(hf)
    useful_out = useful_prompt = generated = padded_prompt = 0
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    _sync(device)
    start = time.perf_counter()
    for batch in tqdm(batches, desc=desc or f"HF generate, static batches of {batch_size}", disable=not progress):
        width, new = max(len(p) for p, _ in batch), max(n for _, n in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)  # [B, width], padded on the left
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        out = hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                          max_new_tokens=new, min_new_tokens=new, pad_token_id=pad, use_cache=True)
        if out.shape[1] - width != new:  # min_new_tokens = max_new_tokens: anything else is a broken peer
            raise RuntimeError(f"HF generate made {out.shape[1] - width} tokens per row, asked for {new}")
        useful_out += sum(n for _, n in batch)
        useful_prompt += sum(len(p) for p, _ in batch)
        generated += len(batch) * new
        padded_prompt += len(batch) * width
    _sync(device)
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "num_requests": len(requests), "num_batches": len(batches),
            "batch_size": batch_size, "output_tokens": useful_out, "prompt_tokens": useful_prompt,
            "generated_tokens": generated, "padded_prompt_tokens": padded_prompt,
            "output_tok_s": useful_out / elapsed, "total_tok_s": (useful_out + useful_prompt) / elapsed,
            "useful_pct": 100 * useful_out / generated}


class _TokenClock:
    """A generate() streamer that keeps the time each new token reaches the host (the first put is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.times.append(time.perf_counter())  # generate() hands over next_tokens.cpu(): the copy is done

    def end(self) -> None:
        pass


@torch.inference_mode()
def one_request(hf, prompt: list[int], new_tokens: int, device: torch.device) -> dict:
    """Batch 1, greedy, exactly `new_tokens`: start time and the time of every token (perf_counter)."""
    clock = _TokenClock()
    ids = torch.tensor([prompt], device=device)  # [1, P]
    _sync(device)
    start = time.perf_counter()
    out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, pad_token_id=pad_token_id(hf), use_cache=True, streamer=clock)
    if out.shape[1] - len(prompt) != new_tokens or len(clock.times) != new_tokens:
        raise RuntimeError(f"HF generate made {out.shape[1] - len(prompt)} tokens, asked for {new_tokens}")
    return {"start": start, "token_times": clock.times}
