"""Linear layers with vLLM's names: where a weight's shape, its checkpoint shards, its storage and its
split across GPUs are decided, so that a model file only says which layers it has.

    ReplicatedLinear            every rank holds the whole [out, in] weight
    ColumnParallelLinear        each rank holds out / tp output rows: y_rank = x W_rank^T  (no communication)
    MergedColumnParallelLinear  several column-parallel weights stacked, e.g. gate_proj and up_proj
    QKVParallelLinear           q_proj, k_proj, v_proj stacked; each rank holds its heads of each
    RowParallelLinear           each rank holds in / tp input columns; partial sums meet in an all-reduce

A Llama MLP is column-parallel up (gate_up_proj), row-parallel down (down_proj): the activation
between them stays split, and one all-reduce per block joins the ranks (Megatron-LM's pattern).
The tensor-parallel size and the collectives come from minillm/distributed/ (chapter 11); with one
rank the splits take everything and the reduce is the identity.

Each layer asks its quant_method (layers/quantization/) to create its parameters and to multiply:
unquantized that is one [out, in] weight and F.linear. Each parameter's `weight_loader` copies a
checkpoint tensor into it: `weight_loader(param, loaded_weight, shard_id)`, where shard_id names the
part of a stacked weight ("q", "k", "v"; 0, 1 for gate, up) and is None for a whole one.
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from .quantization.base import QuantizationConfig, UnquantizedLinearMethod


class ShapeMismatch(ValueError):
    """A checkpoint tensor does not have the shape of the parameter (or shard) it should fill."""

    def __init__(self, got: tuple, want: tuple):
        super().__init__(f"has shape {got}, expected {want}")
        self.got, self.want = got, want


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ShapeMismatch(tuple(src.shape), tuple(dst.shape))
    dst.copy_(src)


class LinearBase(nn.Module):
    """y = x W^T (+ b) through the layer's quant_method; subclasses decide the shapes and loaders."""

    def __init__(self, input_size: int, output_size: int, bias: bool, quant_config: QuantizationConfig | None,
                 prefix: str):
        super().__init__()
        self.input_size, self.output_size, self.prefix = input_size, output_size, prefix
        self.tp_rank, self.tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        self.quant_method = method or UnquantizedLinearMethod()
        self.has_bias = bias

    def _create(self, input_size_per_partition: int, output_partition_sizes: list[int]) -> None:
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = output_partition_sizes
        self.quant_method.create_weights(self, input_size_per_partition, output_partition_sizes,
                                         torch.get_default_dtype(), self.weight_loader)
        if self.has_bias:
            self.bias = nn.Parameter(torch.empty(sum(output_partition_sizes)), requires_grad=False)  # [out]
            self.bias.output_dim, self.bias.weight_loader = 0, self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.has_bias}, tp={self.tp_size}"


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (small layers: a router, a LoRA down-projection)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__(input_size, output_size, bias, quant_config, prefix)
        self._create(input_size, [output_size])

    def weight_loader(self, param, loaded_weight, shard_id=None):
        copy_checked(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)  # [T, in] -> [T, out]


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: rank r holds rows [r * out/tp, (r + 1) * out/tp) of W.

    gather_output=True concatenates the ranks' slices (the full y on every rank); False leaves y split,
    for a RowParallelLinear that takes it as its split input."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 output_sizes: list[int] | None = None):
        super().__init__(input_size, output_size, bias, quant_config, prefix)
        self.gather_output = gather_output
        self.output_sizes = output_sizes or [output_size]  # the stacked parts, unsplit
        self._create(input_size, self._partition_sizes())

    def _partition_sizes(self) -> list[int]:
        """This rank's output features of each stacked part."""
        name = self.prefix or type(self).__name__
        return [divide(s, self.tp_size, f"the {s} output features of {name}") for s in self.output_sizes]

    def weight_loader(self, param, loaded_weight, shard_id=None):
        # this rank's slice of a whole (unstacked) checkpoint tensor
        dim = getattr(param, "output_dim", None)
        if dim is not None:
            size = param.data.shape[dim]
            loaded_weight = loaded_weight.narrow(dim, self.tp_rank * size, size) if self.tp_size > 1 else loaded_weight
        copy_checked(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)  # [T, in] -> [T, out / tp]
        return tensor_model_parallel_all_gather(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel weights stacked along the output: gate_proj and up_proj as one [2I, H] GEMM.
    Shard i of the checkpoint (shard_id = i) fills rows [sum(sizes[:i]), ...) of this rank's slice."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, gather_output: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__(input_size, sum(output_sizes), bias, gather_output, quant_config, prefix, list(output_sizes))
        self.shard_ids = tuple(range(len(output_sizes)))

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is None:  # a checkpoint that already stores the stacked weight
            return copy_checked(param.data, loaded_weight)
        if shard_id not in self.shard_ids:
            raise ValueError(f"{self.prefix or type(self).__name__} has shards {self.shard_ids}, not {shard_id!r}")
        sizes = self.output_partition_sizes
        start, size = sum(sizes[:shard_id]), sizes[shard_id]
        self._load_shard(param, loaded_weight, start, size, self.tp_rank * size)

    def _load_shard(self, param, loaded_weight, start: int, size: int, src_start: int) -> None:
        """Rows [start, start + size) of this rank's parameter <- rows [src_start, ...) of the tensor."""
        dim = getattr(param, "output_dim", None)
        if dim is None:  # a per-tensor scalar (a scale): every shard carries the same
            return copy_checked(param.data, loaded_weight)
        if self.tp_size > 1:
            loaded_weight = loaded_weight.narrow(dim, src_start, size)
        copy_checked(param.data.narrow(dim, start, size), loaded_weight)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q_proj, k_proj and v_proj stacked: [(Hq + 2 Hkv) * D, hidden]. Each rank holds Hq/tp query heads
    and Hkv/tp KV heads of each (a KV head is replicated when there are fewer KV heads than ranks)."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int | None = None,
                 bias: bool = False, quant_config: QuantizationConfig | None = None, prefix: str = ""):
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        tp, name = get_tensor_model_parallel_world_size(), prefix or "QKVParallelLinear"
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp, f"the {total_num_heads} query heads of {name}")
        if tp >= total_num_kv_heads:  # every rank needs a whole KV head: replicate
            if tp % total_num_kv_heads:
                raise ValueError(f"tensor_parallel_size {tp} is neither a divisor nor a multiple of the "
                                 f"{total_num_kv_heads} KV heads of {name} (each rank needs whole KV heads)")
            self.num_kv_heads, self.num_kv_head_replicas = 1, tp // total_num_kv_heads
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp, f"the {total_num_kv_heads} KV heads of {name}")
            self.num_kv_head_replicas = 1
        q, kv = total_num_heads * head_size, total_num_kv_heads * head_size
        super().__init__(hidden_size, [q, kv, kv], bias, False, quant_config, prefix)
        self.shard_ids = ("q", "k", "v")

    def _partition_sizes(self) -> list[int]:
        # whole heads per rank (not an even split of the total when KV heads are replicated)
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        return [q, kv, kv]

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is None:
            return copy_checked(param.data, loaded_weight)
        if shard_id not in self.shard_ids:
            raise ValueError(f"{self.prefix or 'QKVParallelLinear'} has shards q, k, v, not {shard_id!r}")
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        start, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        head_rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.num_kv_head_replicas
        self._load_shard(param, loaded_weight, start, size, head_rank * size)


class RowParallelLinear(LinearBase):
    """Input features split across ranks: rank r holds columns [r * in/tp, ...) of W and computes a
    partial y; the all-reduce sums them (the one communication of an attention or MLP block). The
    bias is added once, after the sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, input_is_parallel: bool = True,
                 reduce_results: bool = True, quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__(input_size, output_size, bias, quant_config, prefix)
        self.input_is_parallel, self.reduce_results = input_is_parallel, reduce_results
        name = prefix or type(self).__name__
        self._create(divide(input_size, self.tp_size, f"the {input_size} input features of {name}"), [output_size])

    def weight_loader(self, param, loaded_weight, shard_id=None):
        dim = getattr(param, "input_dim", None)
        if dim is not None and self.tp_size > 1:
            size = param.data.shape[dim]
            loaded_weight = loaded_weight.narrow(dim, self.tp_rank * size, size)
        copy_checked(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel and self.tp_size > 1:
            x = x.chunk(self.tp_size, dim=-1)[self.tp_rank]  # [T, in / tp]: this rank's columns
        # the bias once: on rank 0 only, so the sum over ranks (this all-reduce, or the caller's when
        # reduce_results=False) counts it once
        y = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        return tensor_model_parallel_all_reduce(y) if self.reduce_results and self.tp_size > 1 else y  # [T, out]
