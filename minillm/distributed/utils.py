"""Sizes that split across ranks, and how a group of spawned processes finds itself."""

from __future__ import annotations

import socket


def _divisors(n: int, upto: int = 16) -> list[int]:
    return [d for d in range(1, min(n, upto) + 1) if n % d == 0]


def divide(numerator: int, denominator: int, what: str | None = None) -> int:
    """numerator / denominator, which must divide exactly (heads, features and vocab across ranks).
    `what` names the thing split ("the 9 query heads of model.layers.0.self_attn.qkv_proj")."""
    if numerator % denominator:
        what = what or f"{numerator}"
        sizes = ", ".join(map(str, _divisors(numerator)))
        raise ValueError(f"tensor_parallel_size {denominator} does not divide {what}; sizes up to 16 that do: "
                         f"{sizes}")
    return numerator // denominator


def tensor_parallel_sizes(config, upto: int = 16) -> list[int]:
    """The tensor-parallel sizes (up to `upto`) that split every layer of a config: query heads and
    the FFN divide evenly, KV heads either divide or are replicated (tp a multiple of them), routed
    experts (config.moe) divide their intermediate size (each rank holds I/tp of every expert), and
    latent attention (config.mla) splits its query heads only: its latent KV belongs to no head and is
    replicated."""
    moe, mla, kv = getattr(config, "moe", None), getattr(config, "mla", None) is not None, config.num_kv_heads
    return [tp for tp in range(1, upto + 1)
            if config.num_heads % tp == 0 and config.intermediate_size % tp == 0
            and (mla or kv % tp == 0 or tp % kv == 0)
            and (moe is None or moe.moe_intermediate_size % tp == 0)]


def check_tensor_parallel_size(config, tp: int) -> None:
    """A clear error before any process starts when `tp` cannot split this model."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, not {tp!r}")
    sizes = tensor_parallel_sizes(config, upto=max(16, tp))
    if tp not in sizes:
        name = getattr(config, "name", "") or getattr(config, "architecture", "the model")
        moe = getattr(config, "moe", None)
        experts = f", routed experts of intermediate size {moe.moe_intermediate_size}" if moe is not None else ""
        mla = ", latent attention" if getattr(config, "mla", None) is not None else ""
        raise ValueError(f"tensor_parallel_size {tp} does not split {name} ({config.num_heads} query heads, "
                         f"{config.num_kv_heads} KV heads, FFN {config.intermediate_size}{experts}{mla}); "
                         f"sizes that do: {', '.join(map(str, sizes))}")


def get_open_port() -> int:
    """A TCP port free on this host now (the OS picks it), for a spawned group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_distributed_init_method(ip: str, port: int) -> str:
    return f"tcp://{ip}:{port}"
