"""Native safetensors loading of every looped family's checkpoints (one file or sharded), and
dummy weights.

Owns: finding the checkpoint files, validating every tensor name, shape and dtype against the config
*before* allocating the model, and copying the weights onto the target device in the target dtype.
Must not: execute checkpoint code, or read anything but config.json, the safetensors index and
safetensors files.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
from safetensors import safe_open

from loopserve.kv.storage import KVScales
from loopserve.models.families import read_model_config
from loopserve.models.huginn import HuginnForCausalLM
from loopserve.models.huginn_config import HuginnConfig
from loopserve.models.layers import Attention
from loopserve.models.looped import LoopedForCausalLM
from loopserve.models.model_config import LoopedConfig
from loopserve.models.nanbeige import NanbeigeForCausalLM
from loopserve.models.nanbeige_config import NanbeigeConfig
from loopserve.models.ouro import OuroForCausalLM
from loopserve.models.ouro_config import OuroConfig
from loopserve.models.quant import prepare_fp8_checkpoint, quantized_linears

logger = logging.getLogger(__name__)

SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
FP8_DTYPE = "F8_E4M3"  # the projections of an fp8 checkpoint (`checkpoint_quantization`)
SCALE_SUFFIX = "_scale"  # X.weight_scale: the fp32 scale of fp8 weight X.weight
# vLLM's per-layer scales of an fp8 KV cache: `model.layers.N.self_attn.k_scale` and `v_scale`.
KV_SCALE_NAMES = ("k_scale", "v_scale")
# The safetensors dtype of each `torch_dtype` a config.json may declare.
DECLARED_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that does not match its config, with what is wrong."""


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in SAFETENSORS_DTYPES.values():
            raise ValueError(f"dtype {name} is not supported; use float32, bfloat16 or float16")
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown dtype {name!r}; choose one of float32, bfloat16, float16"
        ) from None


def build_model(config: LoopedConfig) -> LoopedForCausalLM:
    """The family's model for `config` (on the current default device, uninitialised)."""
    if isinstance(config, OuroConfig):
        return OuroForCausalLM(config)
    if isinstance(config, NanbeigeConfig):
        return NanbeigeForCausalLM(config)
    if isinstance(config, HuginnConfig):
        return HuginnForCausalLM(config)
    raise ValueError(f"no model class for {type(config).__name__}")


# The token embedding's tensor in each family's layout.
EMBEDDING_TENSORS = frozenset({"model.embed_tokens.weight", "transformer.wte.weight"})


def is_norm_weight(name: str) -> bool:
    """Whether a tensor is an RMSNorm's weight (its module's name says norm, or `ln_f`)."""
    parts = name.split(".")
    return parts[-1] == "weight" and len(parts) > 1 and ("norm" in parts[-2] or parts[-2] == "ln_f")


def expected_tensors(config: LoopedConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a checkpoint of the family must hold, with its shape: the model's own
    parameters (its module tree is the HF layout), without a tied LM head. In the order the
    random writer draws them: the body's tensors outside the layers, the layers, the LM head."""
    with torch.device("meta"):
        model = build_model(config)
    shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}

    def group(name: str) -> int:
        return 2 if name == "lm_head.weight" else int(name.startswith("model.layers."))

    return {name: shapes[name] for name in sorted(shapes, key=group)}


def fp8_weights(config: LoopedConfig) -> dict[str, int]:
    """An fp8 checkpoint's e4m3 tensors, each with its output rows N (its `weight_scale` holds
    one value or N); empty for an unquantized checkpoint."""
    if config.checkpoint_quantization != "fp8":
        return {}
    with torch.device("meta"):
        model = build_model(config)
    return {f"{name}.weight": m.weight.shape[0] for name, m in quantized_linears(model).items()}


def kv_scale_tensors(config: LoopedConfig) -> dict[str, tuple[int, int]]:
    """The fp8 KV cache scales a checkpoint may carry (all or none), vLLM's names beside each
    block layer's attention: name -> (KV layer, 0 for K | 1 for V). None in a family whose
    attention has no such names (Huginn's would be unexpected tensors)."""
    with torch.device("meta"):
        model = build_model(config)
    # The block's attention modules in layer order (Ouro's and Nanbeige's: model.layers.N.self_attn)
    block = [name for name, module in model.named_modules() if isinstance(module, Attention)]
    return {
        f"{name}.{suffix}": (layer, kind)
        for layer, name in enumerate(block)
        for kind, suffix in enumerate(KV_SCALE_NAMES)
    }


def checkpoint_files(directory: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it."""
    index_path = directory / INDEX_FILE
    single = directory / SINGLE_FILE
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise CheckpointError(
                f"{index_path}: not a valid safetensors index ({error})"
            ) from None
        files = {name: directory / file for name, file in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.exists():
                raise CheckpointError(f"{index_path} names shard {path.name}, which is missing")
        return files
    if single.exists():
        with safe_open(single, framework="pt") as handle:
            return dict.fromkeys(handle.keys(), single)
    raise CheckpointError(
        f"{directory}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints load)"
    )


def validate_checkpoint(config: LoopedConfig, files: dict[str, Path]) -> None:
    """Check names, shapes and dtypes from the file headers only; raise on the first mismatch."""
    expected = expected_tensors(config)
    fp8 = fp8_weights(config)
    scales = {name + SCALE_SUFFIX: rows for name, rows in fp8.items()}
    kv_scales = kv_scale_tensors(config)
    carried = set(kv_scales) & set(files)
    if carried and carried != set(kv_scales):
        absent = sorted(set(kv_scales) - carried)
        raise CheckpointError(
            f"checkpoint carries fp8 KV cache scales ({', '.join(KV_SCALE_NAMES)}) for some "
            f"layers only: {len(absent)} missing, {', '.join(absent[:4])}"
        )
    missing = sorted((set(expected) | set(scales)) - set(files))
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
    unexpected = sorted(set(files) - set(expected) - set(scales) - carried)
    if config.tie_word_embeddings and unexpected == ["lm_head.weight"]:
        unexpected = []
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
        raise CheckpointError(
            f"checkpoint has unexpected tensor(s) not in a {config.family} model: {shown}"
        )
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for name in [*scales, *carried]:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as handle:
            for name in names:
                view = handle.get_slice(name)
                shape, dtype = tuple(view.get_shape()), view.get_dtype()
                if name in scales:
                    _check_scale(name, path, shape, dtype, scales[name])
                    continue
                if name in carried:
                    _check_kv_scale(name, path, shape, dtype)
                    continue
                if shape != expected[name]:
                    raise CheckpointError(
                        f"tensor {name} in {path.name} has shape {list(shape)}, but the config "
                        f"implies {list(expected[name])}"
                    )
                if name in fp8:
                    if dtype != FP8_DTYPE:
                        raise CheckpointError(
                            f"tensor {name} in {path.name} is {dtype}, but the config's fp8 "
                            f"quantization_config stores the layers' projections as {FP8_DTYPE}"
                        )
                    continue
                _check_dtype(config, name, path, dtype)


def _check_scale(name: str, path: Path, shape: tuple[int, ...], dtype: str, rows: int) -> None:
    if shape not in ((), (1,), (rows,), (rows, 1)) or dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"tensor {name} in {path.name} is {dtype} {list(shape)}; an fp8 weight's scale must "
            f"be a float of shape [], [1], [{rows}] or [{rows}, 1] (per tensor or per channel)"
        )


def _check_kv_scale(name: str, path: Path, shape: tuple[int, ...], dtype: str) -> None:
    if shape not in ((), (1,)) or dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"tensor {name} in {path.name} is {dtype} {list(shape)}; an fp8 KV cache scale must "
            "be one float, of shape [] or [1] (one per layer, as vLLM's)"
        )


def checkpoint_kv_scales(directory: str | Path) -> KVScales | None:
    """The fp8 KV cache scales a checkpoint carries (`kv_scale_tensors`, validated by
    `validate_checkpoint`), each a positive finite float; None when it carries none."""
    directory = Path(directory)
    config = read_model_config(directory / "config.json")
    tensors = kv_scale_tensors(config)
    files = checkpoint_files(directory)
    if not tensors or not set(tensors) <= set(files):
        return None
    scale = torch.ones(config.num_hidden_layers, 2)
    for name, (layer, kind) in tensors.items():
        with safe_open(files[name], framework="pt") as handle:
            value = float(handle.get_tensor(name).float().reshape(()))
        if not (math.isfinite(value) and value > 0):
            raise CheckpointError(
                f"tensor {name} in {files[name].name} is {value}; an fp8 KV cache scale must be "
                "a positive finite number"
            )
        scale[layer, kind] = value
    return KVScales(scale, "checkpoint")


def _check_dtype(config: LoopedConfig, name: str, path: Path, dtype: str) -> None:
    if dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"tensor {name} in {path.name} has dtype {dtype}; "
            "only F32, BF16 and F16 weights are supported"
        )
    declared = config.weights_dtype
    if declared is not None and DECLARED_DTYPES[declared] != dtype:
        raise CheckpointError(
            f"tensor {name} in {path.name} is {dtype}, but config.json declares torch_dtype "
            f"{declared!r}; set torch_dtype to the weights' dtype in config.json"
        )


def _empty_model(
    config: LoopedConfig, dtype: torch.dtype, device: torch.device
) -> LoopedForCausalLM:
    with torch.device("meta"):
        model = build_model(config)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    return model.eval().requires_grad_(False)


def load_checkpoint(
    directory: str | Path, dtype: torch.dtype, device: torch.device | str
) -> LoopedForCausalLM:
    """Load an HF-layout checkpoint directory of any family onto `device` in `dtype`."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory (expected an HF checkpoint folder)")
    config = read_model_config(directory / "config.json")
    files = checkpoint_files(directory)
    validate_checkpoint(config, files)
    device = torch.device(device)
    model = _empty_model(config, dtype, device)
    fp8 = fp8_weights(config)
    if fp8:
        prepare_fp8_checkpoint(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    by_file: dict[Path, list[str]] = {}
    for name in [*expected_tensors(config), *(name + SCALE_SUFFIX for name in fp8)]:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        # Tensors are read straight into device memory, one at a time, then cast there.
        with safe_open(path, framework="pt", device=str(device)) as handle:
            for name in names:
                tensor = handle.get_tensor(name)
                if name in fp8:  # e4m3 as stored
                    params[name].copy_(tensor)
                elif name.removesuffix(SCALE_SUFFIX) in fp8:  # one scale a row
                    params[name].copy_(tensor.float().reshape(-1).expand(params[name].shape))
                else:
                    params[name].copy_(model.load_transform(name, tensor).to(dtype))
    logger.info("loaded %s (%d tensors, %s)", directory, len(params), dtype)
    return model


def dummy_model(
    config: LoopedConfig, dtype: torch.dtype, device: torch.device | str, seed: int = 0
) -> LoopedForCausalLM:
    """Random weights with no file at all (benchmarks); initialised on the device itself."""
    model = _empty_model(config, dtype, torch.device(device))
    generator = torch.Generator(device=torch.device(device)).manual_seed(seed)
    for name, param in model.named_parameters():
        if is_norm_weight(name):
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.normal_(0.0, 0.02, generator=generator)
    return model
