"""Names users bring from TRL (`GRPOConfig`) and verl (`ppo_trainer.yaml`), each with its
`TrainConfig` key or, where masenvs has none, what to use instead.

`load_config` passes `hint` to the unknown-field error, so `--set optim.learning_rate=1e-5`
says "did you mean 'optim.lr'? TRL's learning_rate". docs/training.md shows the same table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ForeignName:
    """One name from another library: our key (None where there is none) and a note."""

    ours: str | None
    origin: str  # whose name it is, as the error shows it: "TRL's learning_rate"
    note: str = ""  # how the value translates, or what to use instead


_TOKEN_MEAN = "the loss is the token mean over an optimizer step's completion tokens"

# Keyed by the name as written, or by a dotted tail of verl's path where the last part
# alone is too common a word (`rollout.n`). Only names with a meaning in masenvs.
NAMES: dict[str, ForeignName] = {
    # --- TRL GRPOConfig (and its TrainingArguments) ----------------------------------------
    "learning_rate": ForeignName("optim.lr", "TRL's learning_rate"),
    "num_generations": ForeignName("rollout.branches", "TRL's num_generations"),
    "max_completion_length": ForeignName("rollout.max_tokens", "TRL's max_completion_length"),
    "max_prompt_length": ForeignName(
        None, "TRL's max_prompt_length", "the env writes the prompts and none is cut"
    ),
    "beta": ForeignName("algorithm.kl_coef", "TRL's beta", "a k3 KL to the base model"),
    "epsilon": ForeignName("algorithm.clip_low", "TRL's epsilon", "set algorithm.clip_high too"),
    "epsilon_high": ForeignName("algorithm.clip_high", "TRL's epsilon_high"),
    "per_device_train_batch_size": ForeignName(
        None,
        "TRL's per_device_train_batch_size",
        "a step trains on rollout.tasks_per_step tasks x rollout.branches candidates; "
        "optim.max_tokens_per_microbatch bounds memory",
    ),
    "gradient_accumulation_steps": ForeignName(
        None,
        "TRL's gradient_accumulation_steps",
        "micro-batches always add up to one optimizer step; algorithm.mini_batches sets "
        "the optimizer steps per batch",
    ),
    "num_iterations": ForeignName("algorithm.ppo_epochs", "TRL's num_iterations"),
    "num_train_epochs": ForeignName(
        "steps", "TRL's num_train_epochs", "a step draws rollout.tasks_per_step new tasks"
    ),
    "max_steps": ForeignName("steps", "TRL's max_steps"),
    "temperature": ForeignName("rollout.temperature", "TRL's temperature"),
    "top_p": ForeignName("rollout.top_p", "TRL's top_p"),
    "top_k": ForeignName("rollout.top_k", "TRL's top_k"),
    "repetition_penalty": ForeignName("rollout.repetition_penalty", "TRL's repetition_penalty"),
    "warmup_ratio": ForeignName(
        None, "TRL's warmup_ratio", "optim.warmup_steps counts warmup in steps"
    ),
    "weight_decay": ForeignName("optim.weight_decay", "TRL's weight_decay"),
    "max_grad_norm": ForeignName("optim.grad_clip", "TRL's max_grad_norm"),
    "adam_beta1": ForeignName("optim.betas", "TRL's adam_beta1", "a pair: [0.9, 0.999]"),
    "adam_beta2": ForeignName("optim.betas", "TRL's adam_beta2", "a pair: [0.9, 0.999]"),
    "adam_epsilon": ForeignName("optim.adam_eps", "TRL's adam_epsilon"),
    "lr_scheduler_type": ForeignName(
        None, "TRL's lr_scheduler_type", "warmup then cosine to optim.min_lr_ratio"
    ),
    "scale_rewards": ForeignName("algorithm.scale_by_std", "TRL's scale_rewards"),
    "loss_type": ForeignName(
        None, "TRL's loss_type", f"{_TOKEN_MEAN} (TRL's 'dapo', verl's 'token-mean')"
    ),
    "output_dir": ForeignName("run_dir", "TRL's output_dir"),
    "save_steps": ForeignName("checkpoint.every", "TRL's save_steps"),
    "save_total_limit": ForeignName("checkpoint.keep_last", "TRL's save_total_limit"),
    "eval_steps": ForeignName("validation.every", "TRL's eval_steps"),
    "use_vllm": ForeignName("backend.kind", "TRL's use_vllm", "backend.kind: vllm"),
    "model_name_or_path": ForeignName("model.name", "TRL's model_name_or_path"),
    "lora_r": ForeignName("lora.rank", "TRL's lora_r"),
    "lora_alpha": ForeignName("lora.alpha", "TRL's lora_alpha"),
    "lora_dropout": ForeignName("lora.dropout", "TRL's lora_dropout"),
    "lora_target_modules": ForeignName("lora.target_modules", "TRL's lora_target_modules"),
    # --- verl (actor_rollout_ref.*, data.*, algorithm.*, trainer.*) ---------------------------
    "lr": ForeignName("optim.lr", "verl's actor_rollout_ref.actor.optim.lr"),
    "lr_warmup_steps": ForeignName("optim.warmup_steps", "verl's actor.optim.lr_warmup_steps"),
    "lr_warmup_steps_ratio": ForeignName(
        None, "verl's actor.optim.lr_warmup_steps_ratio", "optim.warmup_steps counts steps"
    ),
    "grad_clip": ForeignName("optim.grad_clip", "verl's actor_rollout_ref.actor.grad_clip"),
    "rollout.n": ForeignName("rollout.branches", "verl's actor_rollout_ref.rollout.n"),
    "response_length": ForeignName(
        "rollout.max_tokens", "verl's actor_rollout_ref.rollout.response_length"
    ),
    "max_response_length": ForeignName("rollout.max_tokens", "verl's data.max_response_length"),
    "train_batch_size": ForeignName(
        "rollout.tasks_per_step", "verl's data.train_batch_size", "tasks (prompts) per step"
    ),
    "ppo_mini_batch_size": ForeignName(
        "algorithm.mini_batch_size",
        "verl's actor.ppo_mini_batch_size",
        "ours counts samples, verl's prompts (x rollout.n)",
    ),
    "ppo_micro_batch_size_per_gpu": ForeignName(
        "optim.max_tokens_per_microbatch",
        "verl's actor.ppo_micro_batch_size_per_gpu",
        "micro-batches are sized in tokens",
    ),
    "ppo_max_token_len_per_gpu": ForeignName(
        "optim.max_tokens_per_microbatch", "verl's actor.ppo_max_token_len_per_gpu"
    ),
    "ppo_epochs": ForeignName("algorithm.ppo_epochs", "verl's actor.ppo_epochs"),
    "clip_ratio": ForeignName(
        "algorithm.clip_low", "verl's actor.clip_ratio", "set algorithm.clip_high too"
    ),
    "clip_ratio_low": ForeignName("algorithm.clip_low", "verl's actor.clip_ratio_low"),
    "clip_ratio_high": ForeignName("algorithm.clip_high", "verl's actor.clip_ratio_high"),
    "clip_ratio_c": ForeignName("algorithm.clip_c", "verl's actor.clip_ratio_c"),
    "kl_loss_coef": ForeignName(
        "algorithm.kl_coef", "verl's actor.kl_loss_coef", "a k3 ('low_var_kl') KL loss"
    ),
    "use_kl_loss": ForeignName(
        "algorithm.kl_coef", "verl's actor.use_kl_loss", "a coefficient above 0 turns it on"
    ),
    "kl_ctrl.kl_coef": ForeignName(
        "algorithm.kl_coef", "verl's algorithm.kl_ctrl.kl_coef", "a KL loss, not a reward term"
    ),
    "entropy_coeff": ForeignName(
        None, "verl's actor.entropy_coeff", "logging.entropy logs the entropy; none is added"
    ),
    "loss_agg_mode": ForeignName(None, "verl's actor.loss_agg_mode", _TOKEN_MEAN),
    "adv_estimator": ForeignName(
        None,
        "verl's algorithm.adv_estimator",
        "advantages are AT-GRPO's group advantages; algorithm.scale_by_std: false is Dr. GRPO's",
    ),
    "norm_adv_by_std_in_grpo": ForeignName(
        "algorithm.scale_by_std", "verl's algorithm.norm_adv_by_std_in_grpo"
    ),
    "model.path": ForeignName("model.name", "verl's actor_rollout_ref.model.path"),
    "lora_rank": ForeignName("lora.rank", "verl's actor_rollout_ref.model.lora_rank"),
    "enable_gradient_checkpointing": ForeignName(
        "optim.gradient_checkpointing", "verl's model.enable_gradient_checkpointing"
    ),
    "total_training_steps": ForeignName("steps", "verl's trainer.total_training_steps"),
    "total_epochs": ForeignName(
        "steps", "verl's trainer.total_epochs", "a step draws rollout.tasks_per_step new tasks"
    ),
    "save_freq": ForeignName("checkpoint.every", "verl's trainer.save_freq"),
    "test_freq": ForeignName("validation.every", "verl's trainer.test_freq"),
    "default_local_dir": ForeignName("run_dir", "verl's trainer.default_local_dir"),
    "project_name": ForeignName("logging.wandb_project", "verl's trainer.project_name"),
}


def lookup(path: str) -> ForeignName | None:
    """The entry for a dotted key: its longest tail in the table (`a.rollout.n` finds `rollout.n`)."""
    parts = path.split(".")
    for start in range(len(parts)):
        name = NAMES.get(".".join(parts[start:]))
        if name is not None:
            return name
    return None


def describe(name: ForeignName) -> str:
    """`did you mean 'optim.lr'? TRL's learning_rate`, or `masenvs has no TRL X: note`."""
    if name.ours is None:
        whose, _, path = name.origin.partition("'s ")
        return f"masenvs has no {whose} {path.rsplit('.', 1)[-1]}: {name.note}"
    return f"did you mean {name.ours!r}? {name.origin}" + (f"; {name.note}" if name.note else "")


def hint(path: str, value: Any) -> str:
    """The parenthesis after `unknown field` for the unknown key `path` holding `value`: our
    key for a foreign name; for an unknown section (verl's `actor_rollout_ref`), our key for
    every foreign name inside it; '' when nothing is known."""
    name = lookup(path)
    if name is not None:
        return f" ({describe(name)})"
    found = []
    for key in _leaves(path, value):
        inner = lookup(key)
        if inner is not None:
            found.append(f"{key} is {inner.ours!r}" if inner.ours else f"{key}: {describe(inner)}")
    return f" ({'; '.join(found)})" if found else ""


def _leaves(path: str, value: Any) -> list[str]:
    if not isinstance(value, dict):
        return [path]
    return [leaf for key, inner in value.items() for leaf in _leaves(f"{path}.{key}", inner)]
