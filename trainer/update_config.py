"""How the learner updates: the AT-GRPO algorithm's knobs (`algorithm`), the optimizer
(`optim`), which agents share weights (`policy`) and the LoRA shape (`policy.lora`): the
sections of a `TrainConfig` (masenvs.trainer.config) that the learner reads.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from masenvs.overrides import Section


class AlgorithmConfig(Section):
    """AT-GRPO: group-relative advantages and the token-level PPO-clip loss."""

    adv_eps: float = Field(
        1e-6, gt=0.0, description="eps in A = (r - mean) / (std + eps); keeps tiny stds finite."
    )
    unbiased_std: bool = Field(
        False,
        description="Divide by the sample std (n-1) instead of the population std (n). The "
        "population std (default) gives every group unit-RMS advantages whatever its size; "
        "VERL and TRL use the sample std.",
    )
    scale_by_std: bool = Field(
        True,
        description="Divide by the group's reward std (GRPO). False: A = r - mean (Dr. GRPO, "
        "Liu et al. 2025), so a group whose rewards differ by a step cost weighs that little "
        "beside one where a candidate solved the task (docs/learning.md).",
    )
    drop_zero_std_groups: bool = Field(
        False,
        description="Drop groups whose rewards are all equal (their advantages are 0; dropping "
        "them stops them diluting the token mean). Single-sample groups are such groups.",
    )
    keep_top_groups: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Keep this fraction of each policy's groups (rounded up), ranked by "
        "`keep_top_by` among that policy's groups (the authors filter each model's batch "
        "apart); 1.0 keeps all. Applied after `drop_zero_std_groups`.",
    )
    keep_top_by: Literal["std", "mean"] = Field(
        "std",
        description="Rank groups by reward std (most informative first) or by mean reward.",
    )
    clip_low: float = Field(
        0.2, ge=0.0, lt=1.0, description="Ratio lower clip: ratio is clipped at 1 - clip_low."
    )
    clip_high: float = Field(
        0.2, ge=0.0, description="Ratio upper clip: ratio is clipped at 1 + clip_high (DAPO: 0.28)."
    )
    clip_c: float | None = Field(
        3.0,
        gt=1.0,
        description="Dual-clip constant c: for negative advantages the per-token loss is at most "
        "-c * A, so a huge ratio on a bad token cannot blow up the step. None turns it off.",
    )
    kl_coef: float = Field(
        0.0,
        ge=0.0,
        description="Weight of the k3 KL penalty to the base model (adapter disabled); 0 skips "
        "the extra forward pass (the paper's setting).",
    )
    ppo_epochs: int = Field(1, ge=1, description="Passes over each rollout batch.")
    caller_group: Literal["question", "design"] = Field(
        "question",
        description="Groups of the calls an env makes through the endpoint (auto-MAS's "
        "executor): 'question' = all executions of a task's designs, 'design' = the M "
        "executions of one design.",
    )
    mini_batches: int = Field(
        1, ge=1, description="Optimizer steps per epoch; the batch is split into this many parts."
    )
    mini_batch_size: int | None = Field(
        None,
        ge=1,
        description="Samples per optimizer step instead (the ref's `ppo_mini_batch_size`, 16 "
        "in its configs): each policy's batch of N samples takes ceil(N / mini_batch_size) "
        "steps per epoch, so the step count follows the batch; set, it overrides mini_batches.",
    )

    def optimizer_steps(self, samples: int) -> int:
        """Optimizer steps per epoch for a policy's batch of `samples` samples."""
        if self.mini_batch_size is None:
            return self.mini_batches
        return max(1, math.ceil(samples / self.mini_batch_size))

    @model_validator(mode="after")
    def _clip_c_above_upper_clip(self) -> AlgorithmConfig:
        if self.clip_c is not None and self.clip_c <= 1.0 + self.clip_high:
            raise ValueError(
                f"clip_c={self.clip_c} must exceed 1 + clip_high={1 + self.clip_high}; "
                "otherwise the dual clip cuts into the ordinary clip range"
            )
        return self


class OptimConfig(Section):
    """AdamW with linear warmup then cosine decay, gradient clipping, token-budget micro-batches."""

    lr: float = Field(1e-5, gt=0.0, description="Peak learning rate (after warmup).")
    warmup_steps: int = Field(10, ge=0, description="Linear warmup from 0 over this many steps.")
    min_lr_ratio: float = Field(
        0.3, ge=0.0, le=1.0, description="Cosine decay floor as a fraction of `lr`."
    )
    weight_decay: float = Field(0.01, ge=0.0, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    adam_eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    grad_clip: float | None = Field(
        1.0, gt=0.0, description="Max global grad norm per adapter; None turns clipping off."
    )
    share_prompts: bool = Field(
        True,
        description="Feed a prompt once for all samples that share it (the K branches of a "
        "tree node do): their completions attend to one copy. Exact; needs sdpa or eager "
        "attention without sliding windows, else it is skipped.",
    )
    share_prefix: bool = Field(
        True,
        description="Feed the tokens every prompt of a policy's update starts with (chat "
        "template, system prompt, instructions) once per update: every micro-batch attends "
        "to their keys and values, and one backward takes the summed gradient in. Exact. "
        "The no-grad scoring passes (pi_old, the reference) feed it once too. Needs "
        "share_prompts; skipped with gradient checkpointing, across processes, and "
        "under 16 shared tokens.",
    )
    gradient_checkpointing: bool = Field(
        True,
        description="Recompute activations in the backward pass instead of keeping them. On "
        "by default: a 512-token answer goes whole into a micro-batch, whose kept activations "
        "(~0.9 GB for SmolLM2-135M in fp32; ~0.4 GB recomputed) put a run on defaults over the "
        "main job's peak (docs/memory.md). Costs about a third more update compute and skips "
        "share_prefix; the main job, with short answers, sets false.",
    )
    logprob_chunk_tokens: int = Field(
        128,
        ge=1,
        description="Completion tokens scored per chunk: log-probs are computed from the "
        "hidden states chunk by chunk, so fp32 logits over the vocabulary never exist for a "
        "whole micro-batch at once. 128: a chunk's logits, their log-softmax and the "
        "entropy's softmax stay under ~75 MB at a 49k vocabulary; ~95 MB less than 256 in a "
        "checkpointed update, at no measured cost (docs/memory.md).",
    )
    max_tokens_per_microbatch: int = Field(
        512,
        ge=16,
        description="Token budget of one forward/backward (packed rows incl. padding); bounds "
        "memory. Gradients accumulate so the step equals one full-batch step. 512: ~0.7 GB "
        "of SmolLM2-135M activations on a CPU (~1.4 MB per token; a longer sequence goes "
        "whole), so a run on defaults peaks near the main job (docs/memory.md); raise it "
        "on a GPU.",
    )

    def lr_at(self, step: int, total_steps: int) -> float:
        """Learning rate of training step `step` (0-based): linear warmup, then cosine to a
        floor of `min_lr_ratio * lr` at `total_steps`."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)


class PolicyConfig(Section):
    """Which adapter or model each agent trains."""

    mode: Literal["shared", "per_agent", "separate"] = Field(
        "per_agent",
        description="'shared': one LoRA adapter for every agent; 'per_agent': one adapter per "
        "agent on one base model; 'separate': one base model + adapter per agent.",
    )
    shared_name: str = Field("shared", description="Adapter name used in 'shared' mode.")
    finetune: Literal["lora", "full"] = Field(
        "lora",
        description="'lora': train LoRA adapters (the lora section); 'full': train every "
        "parameter of the base model (the paper's headline runs) and sync whole weights to "
        "the backend after each step.",
    )
    models: dict[str, str] = Field(
        default_factory=dict,
        description="'separate' mode: base model per agent; agents not listed use model.name.",
    )

    def policy_of(self, agent: str) -> str:
        """The adapter name that trains (and serves) `agent`."""
        return self.shared_name if self.mode == "shared" else agent

    def policies(self, agents: list[str]) -> list[str]:
        """Adapter names for these agents, in agent order, without repeats."""
        return list(dict.fromkeys(self.policy_of(a) for a in agents))


class LoRAParams(Section):
    """LoRA adapter shape (kept within what vLLM serves: bias 'none', no DoRA)."""

    rank: int = Field(16, ge=1, description="LoRA rank r (vLLM serves up to --max-lora-rank).")
    alpha: int = Field(32, ge=1, description="LoRA alpha; the update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="Modules that get adapters: 'all-linear' (every attention and MLP "
        "projection, not the LM head) or a list of module names such as ['q_proj', 'v_proj'].",
    )
