"""Policy modes: which agents share weights, and the models, adapters and optimizers that hold them.

One `Policy` = one LoRA adapter (or, with `policy.finetune: full`, one whole model) + its own
AdamW. `shared`: one adapter on one base model (or one model); `per_agent`: one adapter per
agent on one base model (or one model per agent); `separate`: one base model and one adapter
per agent. `build_policies` makes them from a `TrainConfig`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer

from masenvs.trainer.config import TrainConfig
from masenvs.trainer.learner import fast_lora
from masenvs.trainer.update_config import OptimConfig

ModelLoader = Callable[[str, torch.device, torch.dtype], Any]
"""(model name, device, dtype) -> a transformers causal LM."""


def load_base_model(name: str, device: torch.device, dtype: torch.dtype) -> Any:
    """Default loader: `masenvs.engine.loading.load_model` ('tiny', 'smollm2-135m', a dir)."""
    from masenvs.engine.loading import load_model

    return load_model(name, device=device, dtype=dtype).model


@dataclass
class Policy:
    """One trainable policy: the model that holds it, its parameters and its optimizer.

    With LoRA `model` is the PeftModel holding the adapter named `name`; with full
    fine-tuning it is the causal LM itself, and `params` are all of its parameters.
    """

    name: str
    model: Any  # PeftModel (LoRA) or a transformers causal LM (full fine-tuning)
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.AdamW
    base_name: str  # model the policy starts from
    share_prompts: bool  # feed a prompt once for all samples that have it (see build_microbatch)
    lr: float  # peak learning rate: agents.<name>.lr, else optim.lr
    frozen: bool = False  # served, never trained (agents.<name>.freeze)
    reference: Any = None  # full fine-tuning with a KL term: a frozen copy of the base model

    @property
    def lora(self) -> bool:
        return isinstance(self.model, PeftModel)


def check_policy_settings(cfg: TrainConfig, agents: Sequence[str]) -> None:
    """`policy.models` and `agents` name only this env's agents, and agents that share a
    policy agree on its learning rate and on freezing."""
    for section, names in (("policy.models", cfg.policy.models), ("agents", cfg.agents)):
        unknown = sorted(set(names) - set(agents))
        if unknown:
            raise ValueError(
                f"{section} names agents {unknown} that are not in this env's agents {list(agents)}"
            )
    for name in cfg.policy.policies(agents):
        members = [a for a in agents if cfg.policy.policy_of(a) == name]
        settings = [cfg.agents.get(a) for a in members]
        frozen = {a: bool(s and s.freeze) for a, s in zip(members, settings, strict=True)}
        if len(set(frozen.values())) > 1:
            raise ValueError(
                f"agents {sorted(a for a, f in frozen.items() if f)} are frozen but share "
                f"policy {name!r} with trained agents "
                f"{sorted(a for a, f in frozen.items() if not f)}; freeze all of them or "
                "use policy.mode per_agent or separate"
            )
        lrs = {a: s.lr for a, s in zip(members, settings, strict=True) if s and s.lr}
        if len(set(lrs.values())) > 1 or (lrs and len(lrs) < len(members)):
            raise ValueError(
                f"agents {members} share policy {name!r} but set different learning rates "
                f"{lrs}; give them one agents.<name>.lr or use policy.mode per_agent"
            )


def lora_config(cfg: TrainConfig) -> LoraConfig:
    """The peft adapter config of `cfg.lora`."""
    lora = cfg.lora
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )


def build_policies(
    cfg: TrainConfig,
    agents: Sequence[str],
    load_base: ModelLoader,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, Policy]:
    """Every policy of `cfg.policy.mode`, its base model(s) loaded by `load_base`."""
    full = cfg.policy.finetune == "full"
    mode = cfg.policy.mode
    names = cfg.policy.policies(agents)
    policies: dict[str, Policy] = {}

    def add(name: str, model: Any, base_name: str) -> None:
        policies[name] = _policy(cfg, agents, name, model, base_name)

    # One model per policy: separate bases, or whole models trained per agent.
    if mode == "separate" or (full and mode == "per_agent"):
        for name in names:
            base_name = cfg.policy.models.get(name, cfg.model.name)
            base = load_base(base_name, device, dtype)
            model = base if full else get_peft_model(base, lora_config(cfg), name)
            fast_lora.install(model)
            add(name, model, base_name)
        return policies
    base = load_base(cfg.model.name, device, dtype)
    if full:  # shared: one model trained on every agent's samples
        add(names[0], base, cfg.model.name)
        return policies
    model = get_peft_model(base, lora_config(cfg), adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, lora_config(cfg))
    fast_lora.install(model)
    for name in names:
        add(name, model, cfg.model.name)
    return policies


def _policy(
    cfg: TrainConfig, agents: Sequence[str], name: str, model: Any, base_name: str
) -> Policy:
    full = cfg.policy.finetune == "full"
    settings = [cfg.agents.get(a) for a in agents if cfg.policy.policy_of(a) == name]
    frozen = any(s is not None and s.freeze for s in settings)
    lr = next((s.lr for s in settings if s is not None and s.lr), cfg.optim.lr)
    if full:
        model.requires_grad_(not frozen)
    params = trainable_params(model, name, full)
    if not params:
        raise ValueError(
            f"LoRA target_modules {cfg.lora.target_modules!r} matched no layer of {base_name}"
        )
    opt = cfg.optim
    optimizer = make_optimizer(params, lr, opt)
    causal_lm = causal_lm_of(model)
    if opt.gradient_checkpointing:
        # Non-reentrant: works with a frozen base (LoRA) and keeps dropout masks exact.
        enable = getattr(causal_lm, "activation_checkpointing_enable", None)  # 5.x name
        (enable or causal_lm.gradient_checkpointing_enable)({"use_reentrant": False})
    reference = None
    if full and cfg.algorithm.kl_coef > 0.0 and not frozen:
        reference = copy.deepcopy(model).requires_grad_(False).eval()
    share = opt.share_prompts and custom_mask_ok(causal_lm.config)
    return Policy(name, model, params, optimizer, base_name, share, lr, frozen, reference)


def trainable_params(model: Any, name: str, full: bool) -> list[torch.nn.Parameter]:
    """The parameters policy `name` trains: its LoRA matrices, or the whole model."""
    if full:
        return list(model.parameters())  # tied embeddings appear once
    params = []
    for module in model.modules():
        if isinstance(module, LoraLayer) and name in module.lora_A:
            params += list(module.lora_A[name].parameters())
            params += list(module.lora_B[name].parameters())
    return params


def make_optimizer(
    params: list[torch.nn.Parameter], lr: float, opt: OptimConfig
) -> torch.optim.AdamW:
    """A policy's AdamW with the `optim` section's betas, eps and weight decay."""
    return torch.optim.AdamW(
        params, lr=lr, betas=opt.betas, eps=opt.adam_eps, weight_decay=opt.weight_decay
    )


def causal_lm_of(model: Any) -> Any:
    """The transformers causal LM under a peft wrapper (or the model itself)."""
    return model.get_base_model() if isinstance(model, PeftModel) else model


def has_dropout(model: Any) -> bool:
    """Whether a train-mode forward is random (LoRA dropout, a model's own dropout)."""
    config = causal_lm_of(model).config
    if any(getattr(config, k, 0.0) for k in ("attention_dropout", "hidden_dropout", "dropout")):
        return True
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


def custom_mask_ok(config: Any) -> bool:
    """Whether a hand-built 4D mask gives exact attention: sdpa or eager, no sliding window."""
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False  # flash-attention kernels take no custom mask
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        return all(t == "full_attention" for t in layer_types)
    if getattr(text, "use_sliding_window", None) is False:
        return True
    return getattr(text, "sliding_window", None) is None


def resolve_device(device: str) -> torch.device:
    """`model.device` ('auto', 'cpu', 'cuda', ...) as a torch device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "model.device is 'cuda' but no CUDA device is visible; use 'cpu' or 'auto'"
        )
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`model.dtype` ('auto', 'float32', 'bfloat16') on `device` as a torch dtype."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
