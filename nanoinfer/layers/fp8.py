"""FP8 weights, as vLLM's `quantization="fp8"`: each decoder projection's weight is stored as float8_e4m3fn
with one float32 scale per output row (its largest magnitude / 448), half the bytes of bf16; so is every MoE
expert's (kernels/moe.py: its grouped GEMM converts them as it loads them, W8A16 at every size; in a bf16
model it multiplies in float16, with x and a 2^-4-scaled intermediate in float16's range, as that module's
docstring says). The embedding, the LM head and an MoE router stay in the model's dtype, as vLLM keeps them.

How a quantized layer multiplies (`linear` in layers/skinny_dispatch.py, which every projection calls):

* decode-sized batches on a GPU: our skinny kernel reads the fp8 weight and multiplies in the activations'
  dtype, the row scale applied in its epilogue (weight only, "W8A16": decode reads the weight bytes, so
  halving them is the gain, and the activations keep their precision);
* larger batches on a GPU in bfloat16: each token's activations are quantized to fp8 with a scale of their
  own (`quantize_per_token`: one Triton kernel on a GPU) and `torch._scaled_mm` multiplies on the fp8
  tensor cores, both scales applied in its epilogue ("W8A8", vLLM's dynamic per-token scheme);
* everywhere else (CPU; float16 / float32 models): the weight is upcast to the activations' dtype and the
  product scaled (W8A16: the reference the tests compare with transformers on the dequantized weights).
  With `enforce_eager` a bf16 GPU model runs W8A8 at every size (the quantization in PyTorch).

Quantized checkpoints (config.json's `quantization_config` with `quant_method` "fp8": DeepSeek / Qwen's
128 x 128 block scales in `weight_scale_inv`, or AutoFP8's per-tensor or per-row `weight_scale`; or
"compressed-tensors" (llm-compressor's "FP8" / "FP8-dynamic" models) whose every group stores 8-bit float
weights, per tensor, per channel or per block in `weight_scale`) load by dequantizing each weight as it is read;
the model is then quantized like a bf16 one once the decoder norms are folded into the projections (the fold scales input features, which a block or row scale cannot carry, so the
weights are rounded a second time). A static `input_scale` is not used: activations are always scaled per token
as they come.

While a model to be quantized is built on a GPU, its projections' and MoE experts' weights are allocated in host
memory (`weights_on_host`): loading and the norm fold run there, and each weight moves to the GPU only to be quantized,
so the GPU never holds the model in its dtype (a model that fits only in fp8 loads), at the cost of the fold's
multiplies on the host.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from nanoinfer.distributed.parallel_state import tp_all_reduce_max, tp_world_size

QUANTIZATION_METHODS = ("fp8",)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# The smallest scale: an all-zero row (or token) then quantizes to zeros instead of 0 / 0.
MIN_SCALE = 1e-12
# Checkpoint tensors that carry an fp8 weight's scales (next to `<module>.weight`).
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale")
_QUANTIZE_ROWS = 4096  # rows quantized at a time: bounds the float32 copy of a large weight
_weights_on_host = False


@contextmanager
def weights_on_host(enabled: bool) -> Iterator[None]:
    """While the model is built (`enabled`: it will be quantized), linear layers and MoE experts allocate their
    weights in host memory (`weight_device`); their `quantize_fp8` moves each to the device as it quantizes it."""
    global _weights_on_host
    previous, _weights_on_host = _weights_on_host, enabled
    try:
        yield
    finally:
        _weights_on_host = previous


def weight_device() -> torch.device | None:
    """Where a linear layer (or MoE experts) being built allocates its weight: the host inside `weights_on_host`,
    else None (the current default device)."""
    return torch.device("cpu") if _weights_on_host else None


def _quantization_config(hf_config: Any) -> dict | None:
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    if not isinstance(config, dict):  # transformers keeps some as objects
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    return config


def resolve_quantization(requested: str | None, hf_config: Any) -> str | None:
    """The method the engine runs: "fp8" for an fp8 checkpoint (its config's `quantization_config`), else
    `requested`. A checkpoint quantized a way nanoinfer does not load is a ValueError."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={requested!r} is not supported; choose one of {list(QUANTIZATION_METHODS)}")
    config = _quantization_config(hf_config)
    if config is None:
        return requested
    checkpoint_block_size(hf_config)  # (checks the method and its scheme)
    return "fp8"


def check_fp8_device(device: torch.device) -> None:
    """fp8 weights on a GPU need fp8 conversions in Triton (our skinny and MoE kernels convert them as they load
    them): compute capability 8.9 or newer (Ada, Hopper). Older GPUs fail when a kernel compiles, mid start-up, so
    they are refused first."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(f"fp8 weights need a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                         f"{torch.cuda.get_device_name(device)} is {major}.{minor}: run the model unquantized")


def checkpoint_block_size(hf_config: Any) -> tuple[int, int] | None:
    """The [rows, columns] of one block scale of an fp8 checkpoint (`weight_block_size`, or a compressed-tensors
    group's `block_structure`), or None (its scales are per tensor or per row). A checkpoint that is not fp8 is a
    ValueError saying why."""
    config = _quantization_config(hf_config) or {}
    method = config.get("quant_method")
    if method == "fp8":
        return _block_size(config.get("weight_block_size"), "weight_block_size")
    if method == "compressed-tensors":
        return _compressed_tensors_block_size(config)
    raise ValueError(f"the checkpoint is quantized with quant_method={method!r}, which nanoinfer does not load; it "
                     f"loads fp8 checkpoints ('fp8', or 'compressed-tensors' with 8-bit float weights) and unquantized "
                     f"ones (which quantization='fp8' quantizes as they load)")


def _block_size(block: Any, what: str) -> tuple[int, int] | None:
    if block is None:
        return None
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"quantization_config's {what} must be two positive integers, got {block!r}")
    return int(block[0]), int(block[1])


def _compressed_tensors_block_size(config: dict) -> tuple[int, int] | None:
    """llm-compressor's format: every config group must store 8-bit float weights (its activations' scheme does not
    matter: they are quantized per token here as they come); one block shape for all block-scaled groups."""
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("a compressed-tensors quantization_config needs config_groups")
    blocks = set()
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise ValueError(f"compressed-tensors group {name!r} stores {weights.get('num_bits')}-bit "
                             f"{weights.get('type')} weights: nanoinfer loads 8-bit float (fp8) ones only")
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"compressed-tensors group {name!r} scales its weights per {strategy!r}: nanoinfer "
                             f"loads per-tensor, per-channel and per-block scales")
        if strategy == "block":
            if weights.get("block_structure") is None:
                raise ValueError(f"compressed-tensors group {name!r} scales per block but gives no block_structure")
            blocks.add(_block_size(weights["block_structure"], "block_structure"))
    if len(blocks) > 1:
        raise ValueError(f"compressed-tensors groups use several block shapes {sorted(blocks)}: one is supported")
    return blocks.pop() if blocks else None


def dequantize_checkpoint_weight(name: str, weight: torch.Tensor, scale: torch.Tensor,
                                 block: tuple[int, int] | None) -> torch.Tensor:
    """A checkpoint's fp8 weight times its scales, in float32: one scale, one per row, or one per `block`
    (the block scale tensor is [ceil(rows / block rows), ceil(columns / block columns)])."""
    if weight.dim() != 2:
        raise ValueError(f"fp8 checkpoint tensor {name!r} has shape {tuple(weight.shape)}: expected a matrix")
    if not scale.dtype.is_floating_point:
        raise ValueError(f"the scale of fp8 checkpoint tensor {name!r} is {scale.dtype}: expected floats")
    rows, cols = weight.shape
    scale = scale.float()
    if scale.numel() == 1:
        expanded = scale.reshape(1, 1)
    elif scale.numel() == rows and scale.shape in ((rows,), (rows, 1)):
        expanded = scale.reshape(rows, 1)
    elif block is not None and scale.shape == (-(-rows // block[0]), -(-cols // block[1])):
        expanded = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    else:
        raise ValueError(f"the scale of fp8 checkpoint tensor {name!r} has shape {tuple(scale.shape)}, which fits "
                         f"neither one scale, one per row ({rows}) nor blocks of {block} over {tuple(weight.shape)}")
    out = weight.float() * expanded
    if not torch.isfinite(out).all():
        raise ValueError(f"fp8 checkpoint tensor {name!r} times its scale is not finite")
    return out


def row_amax(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> each row's largest magnitude, float32 [N] (inf for a row that is not finite)."""
    amax = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], _QUANTIZE_ROWS):
        rows = weight[start:start + _QUANTIZE_ROWS].float()
        amax[start:start + _QUANTIZE_ROWS] = rows.abs().amax(dim=1).masked_fill_(~torch.isfinite(rows).all(dim=1),
                                                                                   float("inf"))
    return amax


def full_row_amax(weight: torch.Tensor, rows_split: bool) -> torch.Tensor:
    """Each row's largest magnitude over the whole row, as one rank would see it. `rows_split`: each tensor-parallel
    rank holds a slice of every row (row-parallel weights), so the rows' amax is all-reduced (fp8 weights, and
    outputs, then do not depend on the tensor-parallel size); else each rank holds whole rows, and the ranks only
    agree whether any weight is not finite, so all of them refuse it (one alone would leave the others waiting in
    the next collective)."""
    amax = row_amax(weight)
    if tp_world_size() == 1:
        return amax
    if rows_split:
        return tp_all_reduce_max(amax)
    if not torch.isfinite(tp_all_reduce_max(amax.max().reshape(1))).all():
        amax.fill_(float("inf"))
    return amax


def quantize_per_row(weight: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (float8_e4m3fn [N, K], float32 scales [N]) with weight ~= q * scale[:, None], each row's largest
    magnitude (`amax`: by default `row_amax(weight)`; a tensor-parallel shard passes its whole row's) mapped to
    448. A weight that is not finite is a ValueError (it would poison its whole row)."""
    amax = row_amax(weight) if amax is None else amax
    if not torch.isfinite(amax).all():
        raise ValueError("cannot quantize a weight that is not finite to fp8")
    scale = _scale(amax)
    q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    for start in range(0, weight.shape[0], _QUANTIZE_ROWS):
        q[start:start + _QUANTIZE_ROWS] = _to_fp8(weight[start:start + _QUANTIZE_ROWS].float(),
                                                 scale[start:start + _QUANTIZE_ROWS, None])
    return q, scale


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale that maps a row's largest magnitude `amax` to 448."""
    return (amax / FP8_MAX).clamp_min(MIN_SCALE)


def _to_fp8(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 `rows` over their `scale`, clamped to +-448 and rounded to float8_e4m3fn (nearest, ties to even)."""
    return (rows / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] activations -> (float8_e4m3fn [M, K], float32 scales [M, 1]), each row's largest magnitude mapped
    to 448: on a GPU with the fused kernels one Triton kernel (kernels/fp8.py), else this math in PyTorch."""
    from nanoinfer.layers.fusion import use_kernels

    if use_kernels(x):
        from nanoinfer.kernels.fp8 import quantize_per_token as kernel

        return kernel(x)
    rows = x.float()
    scale = _scale(rows.abs().amax(dim=1, keepdim=True))
    return _to_fp8(rows, scale), scale


def _scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Where `torch._scaled_mm` with per-row scales runs: a CUDA GPU with fp8 tensor cores (compute capability
    8.9+), bfloat16 output, and both matrix dims multiples of 16."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and weight.shape[0] % 16 == 0
            and weight.shape[1] % 16 == 0 and torch.cuda.get_device_capability(x.device) >= (8, 9))


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (weight * weight_scale[:, None])^T -> [M, N] in x's dtype: W8A8 through `torch._scaled_mm`
    where it runs, else W8A16: the weight upcast to x's dtype, the product scaled in float32. In float16 the
    weight is scaled first (through a float32 copy): q alone, up to 448 / row max times the weight, would
    overflow a float16 product."""
    if _scaled_mm_fits(x, weight):
        q, x_scale = quantize_per_token(x)
        return torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                                out_dtype=x.dtype)
    if x.dtype == torch.float16:
        return F.linear(x, dequantized(weight, weight_scale, x.dtype))
    out = F.linear(x, weight.to(x.dtype))
    return out.mul_(weight_scale) if x.dtype == torch.float32 else (out.float() * weight_scale).to(x.dtype)


def dequantized(weight: torch.Tensor, weight_scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A layer's weight as the matmul means it, in `dtype` (the float16 W8A16 path, references and checks)."""
    if weight_scale is None:
        return weight.to(dtype)
    return (weight.float() * weight_scale[:, None]).to(dtype)
