"""A policy's weights out and in: LoRA adapters in peft/vLLM format, whole models as Hugging
Face directories (config, `model.safetensors`, the base model's tokenizer)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from peft import set_peft_model_state_dict
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file, save_file

from masenvs.engine.loading import model_reference
from masenvs.trainer.learner.policies import Policy, causal_lm_of

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
MODEL_WEIGHTS = "model.safetensors"


def require_lora(p: Policy) -> Policy:
    """`p`, or a clear error when it trains the whole model."""
    if not p.lora:
        raise ValueError(
            f"policy {p.name!r} trains the whole model (policy.finetune: full); its "
            "weights are full_state_dict(policy) / save_model"
        )
    return p


def require_full(p: Policy) -> Policy:
    """`p`, or a clear error when it trains a LoRA adapter."""
    if p.lora:
        raise ValueError(
            f"policy {p.name!r} trains a LoRA adapter (policy.finetune: lora); its weights "
            "are adapter_state_dict(policy)"
        )
    return p


def adapter_state_dict(p: Policy) -> dict[str, torch.Tensor]:
    """The adapter's weights as CPU copies, keyed as in peft's `adapter_model.safetensors`."""
    state = get_peft_model_state_dict(require_lora(p).model, adapter_name=p.name)
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}


def full_state_dict(p: Policy) -> dict[str, torch.Tensor]:
    """Every weight of a fully fine-tuned policy as CPU copies, keyed as in the base model's
    `model.safetensors`; tied weights once, under their first name (as `save_pretrained`)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, tensor in require_full(p).model.state_dict(keep_vars=False).items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().to("cpu", copy=True).contiguous()
    return out


def write_adapter(
    p: Policy, state: dict[str, torch.Tensor], directory: str | Path, targets: str | list[str]
) -> Path:
    """Write `adapter_config.json` + `adapter_model.safetensors` (`state`) of LoRA policy `p`
    (`targets`: the config's `lora.target_modules`)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = copy.deepcopy(p.model.peft_config[p.name])
    config.inference_mode = True
    # The real base (a path or hub id), so peft and vLLM load the adapter elsewhere.
    config.base_model_name_or_path = model_reference(p.base_name)
    if targets == "all-linear":
        # peft resolves 'all-linear' to full module paths; peft and vLLM both match names
        # by their last part, and the short list reads better.
        config.target_modules = sorted({m.rsplit(".", 1)[-1] for m in config.target_modules})
    config.save_pretrained(str(directory))
    return directory


def write_model(p: Policy, state: dict[str, torch.Tensor], directory: str | Path) -> Path:
    """Write `state` (a `full_state_dict`) of `p` as a Hugging Face model directory (config,
    `model.safetensors` and, when it can be found, the base model's tokenizer)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / MODEL_WEIGHTS), metadata={"format": "pt"})
    causal_lm = causal_lm_of(p.model)
    causal_lm.config.save_pretrained(str(directory))
    if causal_lm.generation_config is not None:
        causal_lm.generation_config.save_pretrained(str(directory))
    try:
        from masenvs.engine.loading import ModelLoadError, load_tokenizer

        load_tokenizer(p.base_name).save_pretrained(str(directory))
    except (ModelLoadError, OSError, ValueError):
        pass  # a custom base without a tokenizer on disk: the weights are what resume needs
    return directory


def read_model(directory: str | Path, device: torch.device | str) -> dict[str, torch.Tensor]:
    """The weights of a model directory written by `save_model`, on `device`."""
    path = Path(directory) / MODEL_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist; expected a model written by Learner.save_model"
        )
    return load_file(str(path), device=str(device))


def read_adapter(directory: str | Path, device: torch.device | str) -> dict[str, torch.Tensor]:
    """The weights of an adapter directory written by `save_adapter`, on `device`."""
    path = Path(directory) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist; expected an adapter written by save_adapter"
        )
    return load_file(str(path), device=str(device))


def set_full_state(p: Policy, state: dict[str, torch.Tensor], where: str) -> None:
    """Copy `state` (keyed as `full_state_dict`) into fully fine-tuned policy `p`."""
    expected = full_state_dict(p).keys() if not p.lora else set()
    if p.lora or set(state) != set(expected):
        missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        raise ValueError(
            f"{where} does not fit policy {p.name!r}: missing {missing[:3]}..., "
            f"unexpected {extra[:3]}... (a different base model, or a LoRA policy?)"
        )
    own = p.model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor)


def set_adapter_state(p: Policy, state: dict[str, torch.Tensor], where: str) -> None:
    """Load `state` (keyed as `adapter_state_dict`) into LoRA policy `p` (same shape)."""
    expected = set(get_peft_model_state_dict(p.model, adapter_name=p.name))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(
            f"adapter at {where} does not fit policy {p.name!r}: "
            f"missing {missing[:3]}..., unexpected {extra[:3]}... (different LoRA targets?)"
        )
    set_peft_model_state_dict(p.model, state, adapter_name=p.name)
