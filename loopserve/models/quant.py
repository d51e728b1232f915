"""FP8 weights: a layer's projections stored as float8 e4m3 with one fp32 scale per output row,
and their activations quantized per token as they are multiplied (dynamic W8A8, vLLM's fp8).

Owns: the rules that quantize a weight (`quantize_weight`) and a projection's input
(`quantize_activations`), the module that holds a quantized weight (`Fp8Linear`), which of a
model's matmuls are quantized (`quantize_model`), the torch math of an fp8 projection
(`fp8_linear`, what the CPU and the serial reference run; `scaled_mm`, cuBLAS's fp8 matmul on
Hopper) and the one-matmul concatenation of projections (`fused_linear`). Must not: import triton
(`models.ops.TritonOps` runs the kernels that follow the same rules).

The rules (docs/quantization.md). Row n of W gets scale s[n] = max |W[n, :]| / 448 (1 for a row
of zeros), and W8[n, :] = W[n, :] / s[n] rounded to the nearest e4m3 value (ties to even,
saturating at +-448: `kv.storage.to_cache_dtype`, the fp8 KV cache's rule). Row m of a
projection's input x gets t[m] = max |x[m, :]| * fp32(1 / 448) and x8[m, :] = x[m, :] *
(448 / max |x[m, :]|) rounded the same way (1 and 1 for a row of zeros), so every token has its
own scale. Then
    y[m, n] = round_to_x's_dtype( ((sum over k of x8[m, k] * W8[n, k]) * t[m]) * s[n] ),
the sum in fp32 (a product of two e4m3 values is exact there). A row's value depends on that row
alone, so it can stay independent of its batch where the kernel's summation order does.
Quantized: every bias-free linear of the decoder layers (vLLM's choice: not the LM head, the
embeddings or the exit gate, which stays fp32 and reads the unquantized hidden state).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from loopserve.kv.storage import FP8, FP8_MAX, to_cache_dtype

# Modules never quantized, by their name in the model (the readout).
UNQUANTIZED = frozenset({"lm_head"})


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype) -> (W8 [N, K] float8 e4m3, s [N] fp32), W ~ W8 * s[:, None]."""
    values = weight.float()
    amax = values.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return to_cache_dtype(values / scale[:, None], FP8), scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (x8 [M, K] float8 e4m3, t [M] fp32), one scale per row:
    t = max |x[m, :]| times fp32(1 / 448) and x8 = x times 448 / max |x[m, :]| (a correctly
    rounded division; 1 and 1 for a row of zeros), saturated and rounded as `to_cache_dtype` does.
    (Not amax / 448 for t: torch on CUDA divides by a scalar as a multiplication by its
    reciprocal, so that division's bits would depend on the device.)"""
    values = x.float()
    amax = values.abs().amax(dim=1)
    positive = amax > 0
    scale = torch.where(positive, amax * (1 / FP8_MAX), 1.0)
    # A tensor divided by a tensor: `FP8_MAX / amax` would be amax.reciprocal() * 448, rounded
    # twice.
    inverse = torch.where(positive, torch.full_like(amax, FP8_MAX) / amax, 1.0)
    return to_cache_dtype(values, FP8, inverse[:, None]), scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x quantized per row (`quantize_activations`) times W8^T, the sum scaled by the row's scale
    and then by W's, rounded to x's dtype once, at the end.

    On the CPU, the emulation the tests hold the engine to, the sums are fp64 (rounded to fp32,
    then to x's dtype): the CPU's BLAS blocks fp32 sums by the output width, so a fused
    projection and its parts would differ in the last bit of fp32 outputs."""
    x8, x_scale = quantize_activations(x)
    wide = torch.float64 if x.device.type == "cpu" else torch.float32
    sums = F.linear(x8.to(wide), weight.to(wide))
    return (sums * x_scale.to(wide)[:, None] * scale.to(wide)).float().to(x.dtype)


def scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `scaled_mm` runs x [M, K] by an fp8 W [N, K]: cuBLAS's fp8 matmul with a scale per
    row and per column needs a Hopper GPU (or newer), bf16 output and K, N multiples of 16."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
        and x.shape[1] % 16 == 0
        and weight.shape[0] % 16 == 0
    )


def scaled_mm(
    x8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """`fp8_linear` from already quantized rows, through `torch._scaled_mm` (bf16 out; cuBLAS
    sums and applies the two scales in its own order, so the bits are not the Triton kernels')."""
    return torch._scaled_mm(
        x8, weight.t(), scale_a=x_scale[:, None], scale_b=scale[None, :], out_dtype=torch.bfloat16
    )


class Fp8Linear(nn.Module):
    """A bias-free projection with an fp8 weight [N, K] and its fp32 scale per row [N].

    Both are parameters (never trained), so the model's byte counts (the KV budget's weights,
    the bandwidth floor) see their real sizes."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        if weight.dtype != FP8 or scale.shape != (weight.shape[0],):
            raise ValueError(
                f"Fp8Linear needs a {FP8} weight [N, K] and an fp32 scale [N], got "
                f"{weight.dtype} {list(weight.shape)} and {list(scale.shape)}"
            )
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale.float(), requires_grad=False)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale)

    @classmethod
    def quantize(cls, linear: nn.Linear) -> Fp8Linear:
        if linear.bias is not None:
            raise ValueError("only bias-free projections are quantized")
        return cls(*quantize_weight(linear.weight.detach()))


Linear = nn.Linear | Fp8Linear


def weight_scale(layer: Linear) -> torch.Tensor | None:
    """An fp8 projection's scale per row; None for a projection in the model's dtype."""
    return layer.weight_scale if isinstance(layer, Fp8Linear) else None


def fused_linear(parts: Sequence[Linear]) -> Linear:
    """One bias-free projection whose output is the parts' outputs side by side (fp8 parts keep
    their rows' scales, so the fused output has the parts' bits)."""
    scales = [scale for part in parts if (scale := weight_scale(part)) is not None]
    if scales and len(scales) != len(parts):
        raise ValueError("cannot fuse fp8 projections with unquantized ones")
    weight = torch.cat([part.weight for part in parts], dim=0)
    if scales:
        return Fp8Linear(weight, torch.cat(scales))
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    return fused


def quantization_of(model: object) -> str:
    """How a model's projections are stored: "fp8" when any is an `Fp8Linear`, else "none" (a
    model that is no torch module, a test's fake, has none)."""
    modules = model.modules() if isinstance(model, nn.Module) else ()
    return "fp8" if any(isinstance(module, Fp8Linear) for module in modules) else "none"


def quantized_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The projections fp8 quantizes, by module name: every bias-free linear outside
    `UNQUANTIZED` (an fp8 checkpoint stores exactly these as e4m3 with a `weight_scale`)."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and module.bias is None
        and name.rsplit(".", 1)[-1] not in UNQUANTIZED
    }


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attribute, module)


def quantize_model(model: nn.Module) -> int:
    """Replace every projection of `quantized_linears` by its `Fp8Linear`, in place (after the
    weights are loaded and fused; each bf16 weight is freed as its fp8 copy is made). Returns how
    many were quantized."""
    targets = quantized_linears(model)
    for name, module in targets.items():
        _replace(model, name, Fp8Linear.quantize(module))
    return len(targets)


def prepare_fp8_checkpoint(model: nn.Module) -> None:
    """Before an fp8 checkpoint loads: every projection of `quantized_linears` becomes an
    `Fp8Linear` with room for the checkpoint's e4m3 weight and scale (contents unset)."""
    for name, module in quantized_linears(model).items():
        rows, depth = module.weight.shape
        device = module.weight.device
        weight = torch.empty(rows, depth, dtype=FP8, device=device)
        _replace(model, name, Fp8Linear(weight, torch.ones(rows, device=device)))
