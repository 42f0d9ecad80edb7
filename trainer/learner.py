"""The learner: LoRA adapters or whole causal LMs, updated with the AT-GRPO loss.

One `Policy` = one adapter (or, with `policy.finetune: full`, one whole model) + its own
AdamW. The policy mode decides how they share weights: `shared` (one adapter on one base
model, or one model), `per_agent` (one adapter per agent on one base model, or one model
per agent; an agent's samples only ever touch its own weights), `separate` (one base model
and one adapter per agent). `Learner.step(samples)` is one training step for every policy.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from torch.utils.checkpoint import checkpoint

from masenvs.adapters.models import model_reference
from masenvs.trainer.atgrpo import LossSums, policy_loss
from masenvs.trainer.config import OptimConfig, TrainConfig
from masenvs.trainer.samples import Sample

ModelLoader = Callable[[str, torch.device, torch.dtype], Any]
"""(model name, device, dtype) -> a transformers causal LM."""

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
MODEL_WEIGHTS = "model.safetensors"


def load_base_model(name: str, device: torch.device, dtype: torch.dtype) -> Any:
    """Default loader: `masenvs.adapters.models.load_model` ('tiny', 'smollm2-135m', a dir)."""
    from masenvs.adapters.models import load_model

    return load_model(name, device=device, dtype=dtype).model


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate of training step `step` (0-based): linear warmup, then cosine to a floor."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


# ---------------------------------------------------------------------------------------------
# Packing: sequences -> rows -> micro-batches
# ---------------------------------------------------------------------------------------------


Unit = list[int]
"""Batch indices of samples fed as one copy of their shared prompt followed by each completion."""


def prompt_units(batch: Sequence[Sample], share: bool, max_tokens: int | None = None) -> list[Unit]:
    """Group samples with identical prompts (the K branches of a tree node have one prompt).

    With `max_tokens`, a prompt whose completions do not fit the budget together is split
    into several units, each repeating the prompt: the K completions of one prompt may then
    go to different micro-batches (a lone sequence longer than the budget stays whole).
    """
    if not share:
        return [[i] for i in range(len(batch))]
    units: dict[tuple[int, ...], Unit] = {}
    for i, s in enumerate(batch):
        units.setdefault(tuple(s.prompt_token_ids), []).append(i)
    if max_tokens is None:
        return list(units.values())
    split: list[Unit] = []
    for unit in units.values():
        prompt = len(batch[unit[0]].prompt_token_ids)
        part: Unit = []
        used = prompt
        for i in unit:
            extra = len(batch[i].completion_token_ids) - 1
            if part and used + extra > max_tokens:
                split.append(part)
                part, used = [], prompt
            part.append(i)
            used += extra
        split.append(part)
    return split


def unit_length(batch: Sequence[Sample], unit: Unit) -> int:
    """Input tokens of a unit: the prompt once, then each completion but its last token."""
    prompt = len(batch[unit[0]].prompt_token_ids)
    return prompt + sum(len(batch[i].completion_token_ids) - 1 for i in unit)


def plan_microbatches(lengths: Sequence[int], max_tokens: int) -> list[list[list[int]]]:
    """Pack units (by length) into rows, and rows into micro-batches of <= `max_tokens`.

    Rows are as wide as the longest unit, filled first-fit-decreasing, so padding is small
    and attention (quadratic in row width) stays as cheap as without packing. A unit longer
    than `max_tokens` gets a micro-batch to itself.
    Returns micro-batches -> rows -> unit indices.
    """
    if not lengths:
        return []
    width = max(lengths)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r in range(len(rows)):
            if room[r] >= lengths[i]:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    per_batch = max(1, max_tokens // width)
    return [rows[k : k + per_batch] for k in range(0, len(rows), per_batch)]


@dataclass
class MicroBatch:
    """Packed rows of units: [prompt][completion 1 minus last token][completion 2 ...] ..."""

    samples: list[int]  # batch indices, in the order their tokens appear in `targets`
    input_ids: torch.Tensor  # [rows, width]
    position_ids: torch.Tensor  # [rows, width]; each completion continues its prompt's positions
    score_index: torch.Tensor  # [n] flat positions whose next token is a completion token
    targets: torch.Tensor  # [n] those completion tokens
    attention_mask: torch.Tensor | None  # [rows, 1, width, width] bool, when prompts are shared
    # Sampling temperature the tokens are scored at: one for all, or [n, 1] when agents differ.
    temperature: float | torch.Tensor = 1.0
    tokens: int = 0  # real (not padding) input tokens, for the FLOP count
    attended: int = 0  # (query, key) pairs among real tokens that attention computes


def build_microbatch(batch: Sequence[Sample], rows: list[list[Unit]]) -> MicroBatch:
    """Lay out rows of units; `attention_mask` is None when no prompt is shared.

    Without sharing, position ids that restart at 0 are enough: transformers derives a
    block-diagonal causal mask from them. With sharing, each completion must see its prompt
    but not its sibling completions, so the mask is built here (True = may attend).
    """
    width = max(sum(unit_length(batch, u) for u in row) for row in rows)
    shared = any(len(u) > 1 for row in rows for u in row)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    position_ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), 1, width, width, dtype=torch.bool) if shared else None
    order: list[int] = []
    score: list[int] = []
    targets: list[int] = []
    tokens = attended = 0
    for r, row in enumerate(rows):
        o = 0  # where the current unit starts
        for unit in row:
            prompt = batch[unit[0]].prompt_token_ids
            p = len(prompt)
            tokens += p
            attended += p * (p + 1) // 2
            input_ids[r, o : o + p] = torch.tensor(prompt)
            position_ids[r, o : o + p] = torch.arange(p)
            if mask is not None:
                mask[r, 0, o : o + p, o : o + p] = _causal(p)
            start = o + p  # where the current completion starts
            for i in unit:
                completion = batch[i].completion_token_ids
                n = len(completion) - 1
                tokens += n
                attended += n * p + n * (n + 1) // 2  # its prompt, then itself causally
                input_ids[r, start : start + n] = torch.tensor(completion[:-1])
                position_ids[r, start : start + n] = torch.arange(p, p + n)
                if mask is not None:
                    mask[r, 0, start : start + n, o : o + p] = True
                    mask[r, 0, start : start + n, start : start + n] = _causal(n)
                # completion[0] is predicted by the prompt's last position, completion[j] by
                # the position of completion[j - 1]
                base = r * width
                score += [base + o + p - 1] + [base + start + j for j in range(n)]
                targets += completion
                order.append(i)
                start += n
            o = start
        # Padding is its own sequence (positions restart at 0): real tokens never attend to it.
        position_ids[r, o:] = torch.arange(width - o)
        if mask is not None:
            mask[r, 0, o:, o:] = _causal(width - o)  # no fully masked row (NaN in softmax)
    return MicroBatch(
        samples=order,
        input_ids=input_ids,
        position_ids=position_ids,
        score_index=torch.tensor(score, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        attention_mask=mask,
        tokens=tokens,
        attended=attended,
    )


def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


# ---------------------------------------------------------------------------------------------
# The learner
# ---------------------------------------------------------------------------------------------


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


@dataclass
class _Scored:
    logprobs: torch.Tensor  # [n] at the training temperature; with grad in the update pass
    raw_logprobs: torch.Tensor  # [n] at T=1 (what backends report), no grad
    entropy_sum: float


class Learner:
    """Policies (LoRA adapters or whole models) and their optimizers; `step(samples)` runs
    one AT-GRPO update."""

    def __init__(
        self,
        cfg: TrainConfig,
        agents: Sequence[str],
        load_base: ModelLoader = load_base_model,
    ) -> None:
        self.cfg = cfg
        self.agents = list(agents)
        if not self.agents:
            raise ValueError("the learner needs at least one agent")
        self.full = cfg.policy.finetune == "full"
        self.device = _resolve_device(cfg.model.device)
        self.dtype = _resolve_dtype(cfg.model.dtype, self.device)
        # Full fine-tuning on a GPU with dtype 'auto': fp32 master weights (and AdamW state),
        # bf16 compute through autocast. Updates of lr ~1e-6 would mostly round away in bf16
        # weights; model.dtype: bfloat16 keeps them in bf16 anyway, for half the memory.
        self.autocast: torch.dtype | None = None
        if self.full and cfg.model.dtype == "auto" and self.dtype == torch.bfloat16:
            self.dtype, self.autocast = torch.float32, torch.bfloat16
        self.steps_done = 0  # the LR schedule's position: training steps completed
        self.flops = 0.0  # model FLOPs of the passes run so far (see `forward_flops`)
        self._linear_params: dict[int, int] = {}  # per causal LM: weights of its linear layers
        for section, names in (("policy.models", cfg.policy.models), ("agents", cfg.agents)):
            unknown = sorted(set(names) - set(self.agents))
            if unknown:
                raise ValueError(
                    f"{section} names agents {unknown} that are not in this env's agents "
                    f"{self.agents}"
                )
        self._check_policy_settings()
        self.policies: dict[str, Policy] = {}
        # Adapter init draws from torch's RNG: fork it so init depends on cfg.seed only.
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            torch.manual_seed(cfg.seed)
            # peft 0.21 reads a transformers attribute deprecated in 5.x; not actionable here.
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
            self._build(load_base)

    # -- construction -----------------------------------------------------------------------

    def _check_policy_settings(self) -> None:
        """Agents that share a policy must agree on its learning rate and on freezing."""
        for name in self.cfg.policy.policies(self.agents):
            members = [a for a in self.agents if self.policy_of(a) == name]
            settings = [self.cfg.agents.get(a) for a in members]
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

    def _lora_config(self) -> LoraConfig:
        lora = self.cfg.lora
        return LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules,
            bias="none",
            task_type="CAUSAL_LM",
        )

    def _build(self, load_base: ModelLoader) -> None:
        mode = self.cfg.policy.mode
        names = self.cfg.policy.policies(self.agents)
        # One model per policy: separate bases, or whole models trained per agent.
        if mode == "separate" or (self.full and mode == "per_agent"):
            for name in names:
                base_name = self.cfg.policy.models.get(name, self.cfg.model.name)
                base = load_base(base_name, self.device, self.dtype)
                model = base if self.full else get_peft_model(base, self._lora_config(), name)
                self._add_policy(name, model, base_name)
            return
        base = load_base(self.cfg.model.name, self.device, self.dtype)
        if self.full:  # shared: one model trained on every agent's samples
            self._add_policy(names[0], base, self.cfg.model.name)
            return
        model = get_peft_model(base, self._lora_config(), adapter_name=names[0])
        for name in names[1:]:
            model.add_adapter(name, self._lora_config())
        for name in names:
            self._add_policy(name, model, self.cfg.model.name)

    def _add_policy(self, name: str, model: Any, base_name: str) -> None:
        settings = [self.cfg.agents.get(a) for a in self.agents if self.policy_of(a) == name]
        frozen = any(s is not None and s.freeze for s in settings)
        lr = next((s.lr for s in settings if s is not None and s.lr), self.cfg.optim.lr)
        if self.full:
            model.requires_grad_(not frozen)
        params = self._trainable_params(model, name)
        if not params:
            raise ValueError(
                f"LoRA target_modules {self.cfg.lora.target_modules!r} matched no layer "
                f"of {base_name}"
            )
        opt = self.cfg.optim
        optimizer = self._optimizer(params, lr)
        causal_lm = _causal_lm(model)
        if opt.gradient_checkpointing:
            # Non-reentrant: works with a frozen base (LoRA) and keeps dropout masks exact.
            enable = getattr(causal_lm, "activation_checkpointing_enable", None)  # 5.x name
            (enable or causal_lm.gradient_checkpointing_enable)({"use_reentrant": False})
        reference = None
        if self.full and self.cfg.algorithm.kl_coef > 0.0 and not frozen:
            reference = copy.deepcopy(model).requires_grad_(False).eval()
        share = opt.share_prompts and _custom_mask_ok(causal_lm.config)
        self.policies[name] = Policy(
            name, model, params, optimizer, base_name, share, lr, frozen, reference
        )

    def _trainable_params(self, model: Any, name: str) -> list[torch.nn.Parameter]:
        """The parameters policy `name` trains: its LoRA matrices, or the whole model."""
        if self.full:
            return list(model.parameters())  # tied embeddings appear once
        params = []
        for module in model.modules():
            if isinstance(module, LoraLayer) and name in module.lora_A:
                params += list(module.lora_A[name].parameters())
                params += list(module.lora_B[name].parameters())
        return params

    def _optimizer(self, params: list[torch.nn.Parameter], lr: float) -> torch.optim.AdamW:
        opt = self.cfg.optim
        return torch.optim.AdamW(
            params, lr=lr, betas=opt.betas, eps=opt.adam_eps, weight_decay=opt.weight_decay
        )

    def policy_of(self, agent: str) -> str:
        return self.cfg.policy.policy_of(agent)

    def trains(self, policy: str) -> bool:
        """Whether `policy` is trained (False for frozen agents' policies)."""
        return not self._policy(policy).frozen

    def _policy(self, name: str) -> Policy:
        if name not in self.policies:
            raise KeyError(f"unknown policy {name!r}; policies are {sorted(self.policies)}")
        return self.policies[name]

    # -- one training step ------------------------------------------------------------------

    def step(
        self, samples: list[Sample], lr_scale: dict[str, float] | None = None
    ) -> dict[str, float]:
        """Update every trained policy on its own samples (which carry advantages).

        Policies without samples this step keep their weights, but the LR schedule of every
        policy advances: it counts training steps. Samples of frozen policies are ignored
        (the training loop drops them before grouping).
        """
        start, cpu_start = time.perf_counter(), time.process_time()
        flops_before = self.flops
        by_policy: dict[str, list[Sample]] = defaultdict(list)
        for s in samples:
            if s.advantage is None:
                raise ValueError(
                    "samples need advantages: run group_advantages(samples, cfg) first"
                )
            if self._policy(s.policy).frozen:
                continue
            if s.completion_token_ids:  # an empty completion has no token to train
                by_policy[s.policy].append(s)
        lr = lr_at(self.steps_done, self.cfg.optim, self.cfg.steps)
        metrics: dict[str, float] = {"learner/lr": lr}
        tokens = 0
        for name, policy in self.policies.items():
            if by_policy.get(name):
                policy_lr = lr * policy.lr / self.cfg.optim.lr  # same schedule, own peak
                policy_lr *= (lr_scale or {}).get(name, 1.0)  # a training schedule's phase
                for key, value in self._update(policy, by_policy[name], policy_lr).items():
                    metrics[f"learner/{name}/{key}"] = value
                tokens += sum(s.num_tokens for s in by_policy[name])
        self.steps_done += 1
        elapsed = time.perf_counter() - start
        metrics["learner/time_s"] = elapsed
        metrics["learner/tokens_per_s"] = tokens / elapsed if elapsed > 0 else 0.0
        # Model FLOPs (recomputation not counted): against a matmul's peak this is the MFU.
        metrics["learner/gflops"] = (self.flops - flops_before) / 1e9
        metrics["learner/gflop_per_s"] = metrics["learner/gflops"] / elapsed if elapsed > 0 else 0.0
        metrics["learner/cpu_s"] = time.process_time() - cpu_start  # every thread of the process
        return metrics

    def _update(self, policy: Policy, batch: list[Sample], lr: float) -> dict[str, float]:
        algo = self.cfg.algorithm
        model = policy.model
        if policy.lora:
            model.set_adapter(policy.name)  # only this adapter is active and requires grad

        # pi_old: with a single optimizer step on this batch (the default), the update's own
        # forward runs at the current weights, so its detached log-probs *are* the old ones.
        # More steps (or dropout, which makes the train-mode forward differ) need a
        # separate no-grad pass first.
        one_step = algo.ppo_epochs * algo.optimizer_steps(len(batch)) == 1
        one_step = one_step and not _has_dropout(model)
        old: list[torch.Tensor] | None = None
        ref: list[torch.Tensor] | None = None
        mismatch = _Mismatch()
        if not one_step:
            old, raw = self._score(policy, batch)
            mismatch.add(batch, range(len(batch)), raw)
        if algo.kl_coef > 0.0:
            ref, _ = self._score(policy, batch, base=True)

        sums = LossSums()
        grad_norms: list[float] = []
        # How far this step moves the adapter (a LoRA copy is small; whole models are not copied).
        start = [p.detach().clone() for p in policy.params] if policy.lora else None
        model.train()
        for epoch in range(algo.ppo_epochs):
            for part in self._mini_batches(len(batch), epoch):
                policy.optimizer.zero_grad(set_to_none=True)
                self._accumulate_gradients(
                    model, batch, part, old, ref, sums, mismatch if one_step else None,
                    policy.share_prompts,
                )  # fmt: skip
                max_norm = self.cfg.optim.grad_clip or math.inf
                grad_norms.append(float(torch.nn.utils.clip_grad_norm_(policy.params, max_norm)))
                for group in policy.optimizer.param_groups:
                    group["lr"] = lr
                policy.optimizer.step()
        model.eval()

        out = sums.means()
        if not self.cfg.logging.entropy:
            out.pop("entropy", None)
        out["loss"] = out["pg_loss"] + algo.kl_coef * out["kl_ref"]
        out["grad_norm"] = sum(grad_norms) / len(grad_norms)
        out["lr"] = lr
        out["samples"] = float(len(batch))
        out["optimizer_steps"] = float(len(grad_norms))  # epochs x mini-batches
        out["advantage_mean"] = sum(s.advantage or 0.0 for s in batch) / len(batch)
        if start is not None:
            moved = sum(float((p.detach() - b).pow(2).sum()) for p, b in zip(policy.params, start))
            size = sum(float(b.pow(2).sum()) for b in start)
            out["update_norm"] = math.sqrt(moved)  # ||w_after - w_before||
            out["update_rel"] = math.sqrt(moved / size) if size else 0.0  # / ||w_before||
        out.update(mismatch.means())
        return out

    def _accumulate_gradients(
        self,
        model: Any,
        batch: list[Sample],
        part: list[int],
        old: list[torch.Tensor] | None,
        ref: list[torch.Tensor] | None,
        sums: LossSums,
        mismatch: _Mismatch | None,
        share: bool,
    ) -> None:
        """Backward of the token-mean loss of `batch[part]`, one micro-batch at a time."""
        sub = [batch[i] for i in part]
        num_tokens = sum(len(s.completion_token_ids) for s in sub)  # the token mean's N
        for mb in self._microbatches(sub, share):
            scored = self._forward(model, mb, with_entropy=self.cfg.logging.entropy)
            idx = [part[i] for i in mb.samples]  # back to batch indices
            old_lp = _gather(old, idx) if old is not None else scored.logprobs.detach()
            ref_lp = _gather(ref, idx) if ref is not None else None
            adv = torch.cat(
                [torch.full((len(batch[i].completion_token_ids),), batch[i].advantage) for i in idx]
            ).to(self.device)
            loss, mb_sums = policy_loss(
                scored.logprobs, old_lp, adv, num_tokens, self.cfg.algorithm, ref_logprobs=ref_lp
            )
            loss.backward()
            mb_sums.extra["entropy"] = scored.entropy_sum
            sums.add(mb_sums)
            if mismatch is not None:  # this forward ran at the generating weights
                mismatch.add(batch, idx, _split(scored.raw_logprobs, batch, idx))

    def _mini_batches(self, n: int, epoch: int) -> list[list[int]]:
        """Split batch indices into `mini_batches` parts (or parts of `mini_batch_size`);
        shuffled (seeded by step and epoch)."""
        parts = self.cfg.algorithm.optimizer_steps(n)
        if parts == 1:
            return [list(range(n))]
        gen = torch.Generator().manual_seed(
            self.cfg.seed * 1_000_003 + self.steps_done * 1_009 + epoch
        )
        order = torch.randperm(n, generator=gen).tolist()
        size = math.ceil(n / parts)
        return [order[k : k + size] for k in range(0, n, size)]

    # -- scoring ----------------------------------------------------------------------------

    @torch.no_grad()
    def logprobs(
        self, policy: str, samples: Sequence[Sample], base: bool = False
    ) -> list[torch.Tensor]:
        """Per-token log-probs of each sample's completion under the current weights (no grad).

        At the training temperature; `base=True` scores with the base model (the adapter
        disabled, or the frozen reference copy of full fine-tuning).
        """
        return self._score(self._policy(policy), list(samples), base=base)[0]

    @torch.no_grad()
    def _score(
        self, policy: Policy, batch: list[Sample], base: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        model = policy.model
        if base and self.full:
            if policy.reference is None:
                raise ValueError(
                    f"policy {policy.name!r} keeps no reference model (full fine-tuning keeps "
                    "one only when algorithm.kl_coef > 0)"
                )
            model = policy.reference
        if policy.lora:
            model.set_adapter(policy.name)
        model.eval()
        empty = torch.zeros(0, device=self.device)
        scored = [empty] * len(batch)
        raw = [empty] * len(batch)
        todo = [i for i, s in enumerate(batch) if s.completion_token_ids]
        sub = [batch[i] for i in todo]
        for mb in self._microbatches(sub, policy.share_prompts):
            if base and policy.lora:
                with model.disable_adapter():
                    out = self._forward(model, mb, with_entropy=False)
            else:
                out = self._forward(model, mb, with_entropy=False)
            lps = _split(out.logprobs, sub, mb.samples)
            raws = _split(out.raw_logprobs, sub, mb.samples)
            for j, lp, r in zip(mb.samples, lps, raws, strict=True):
                scored[todo[j]], raw[todo[j]] = lp, r
        return scored, raw

    def _microbatches(self, batch: list[Sample], share: bool) -> Iterator[MicroBatch]:
        """Prompt units packed into rows, rows into micro-batches within the token budget."""
        budget = self.cfg.optim.max_tokens_per_microbatch
        units = prompt_units(batch, share, budget)
        lengths = [unit_length(batch, u) for u in units]
        for rows in plan_microbatches(lengths, budget):
            mb = build_microbatch(batch, [[units[u] for u in row] for row in rows])
            mb.temperature = self._temperature([batch[i] for i in mb.samples])
            yield mb

    def _temperature(self, samples: list[Sample]) -> float | torch.Tensor:
        """Each sample's agent's sampling temperature (`agents.<name>`, else rollout's)."""
        of = {a: self.cfg.agent(a).temperature for a in {s.agent for s in samples}}
        if len(set(of.values())) == 1:
            return float(next(iter(of.values())))
        return torch.cat(
            [torch.full((len(s.completion_token_ids), 1), of[s.agent]) for s in samples]
        )

    def _forward(self, model: Any, mb: MicroBatch, with_entropy: bool) -> _Scored:
        """Log-probs of the micro-batch's completion tokens (grad follows the caller's mode)."""
        causal_lm = _causal_lm(model)
        input_ids = mb.input_ids.to(self.device)
        position_ids = mb.position_ids.to(self.device)
        index = mb.score_index.to(self.device)
        targets = mb.targets.to(self.device)
        inputs: dict[str, Any] = {"input_ids": input_ids, "position_ids": position_ids}
        if mb.attention_mask is not None:  # shared prompts; else position ids delimit sequences
            mask = mb.attention_mask.to(self.device)
            inputs["attention_mask"] = _mask_for(
                causal_lm.config, mask, self.autocast or self.dtype
            )
        self.flops += self._pass_flops(model, causal_lm, mb)
        with torch.autocast(self.device.type, self.autocast, enabled=self.autocast is not None):
            return self._score_tokens(
                causal_lm, inputs, index, targets, mb.temperature, with_entropy
            )

    def _pass_flops(self, model: Any, causal_lm: Any, mb: MicroBatch) -> float:
        """Model FLOPs of this pass: the forward, and with grad the backward (activation
        gradients, plus weight gradients when the whole model trains)."""
        key = id(causal_lm)
        if key not in self._linear_params:
            self._linear_params[key] = linear_params(causal_lm)
        params = self._linear_params[key]
        if isinstance(model, PeftModel):  # the active adapter's matrices
            params += sum(p.numel() for p in model.parameters() if p.requires_grad)
        forward = forward_flops(causal_lm.config, params, mb)
        if not torch.is_grad_enabled():
            return forward
        return forward * (3.0 if self.full else 2.0)

    def _score_tokens(
        self,
        causal_lm: Any,
        inputs: dict[str, Any],
        index: torch.Tensor,
        targets: torch.Tensor,
        temperature: float | torch.Tensor,
        with_entropy: bool,
    ) -> _Scored:
        if isinstance(temperature, torch.Tensor):
            temperature = temperature.to(self.device)
        if _plain_lm_head(causal_lm.config):
            # Only the positions that predict completion tokens go through the LM head, in
            # chunks (see token_logprobs): the head is a big matmul, and its fp32 logits are
            # the largest tensor of the step.
            backbone = getattr(causal_lm, causal_lm.base_model_prefix)
            hidden = backbone(**inputs, use_cache=False).last_hidden_state
            hidden = hidden.reshape(-1, hidden.shape[-1])[index]
            head = causal_lm.get_output_embeddings()
        else:  # heads with soft-capping or scaling: let the model apply them (not chunked)
            logits = causal_lm(**inputs, use_cache=False).logits
            hidden = logits.reshape(-1, logits.shape[-1])[index]
            head = None
        return token_logprobs(
            head,
            hidden,
            targets,
            temperature,
            self.cfg.optim.logprob_chunk_tokens,
            with_entropy=with_entropy,
        )

    # -- weights out and in -----------------------------------------------------------------

    def adapter_state_dict(self, policy: str) -> dict[str, torch.Tensor]:
        """The adapter's weights as CPU copies, keyed as in peft's `adapter_model.safetensors`."""
        p = self._lora_policy(policy)
        state = get_peft_model_state_dict(p.model, adapter_name=policy)
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}

    def full_state_dict(self, policy: str) -> dict[str, torch.Tensor]:
        """Every weight of a fully fine-tuned policy as CPU copies, keyed as in the base
        model's `model.safetensors` (`model.layers.0.self_attn.q_proj.weight`, ...).

        Tied weights appear once, under their first name (an LM head tied to the input
        embedding is `model.embed_tokens.weight` only), as `save_pretrained` writes them.
        """
        p = self._policy(policy)
        if p.lora:
            raise ValueError(
                f"policy {policy!r} trains a LoRA adapter (policy.finetune: lora); its weights "
                "are adapter_state_dict(policy)"
            )
        out: dict[str, torch.Tensor] = {}
        seen: set[tuple[int, int]] = set()
        for name, tensor in p.model.state_dict(keep_vars=False).items():
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
            if key in seen:
                continue
            seen.add(key)
            out[name] = tensor.detach().to("cpu", copy=True).contiguous()
        return out

    def save_model(self, policy: str, directory: str | Path) -> Path:
        """Write a fully fine-tuned policy as a Hugging Face model directory (config,
        `model.safetensors` and, when it can be found, the base model's tokenizer), which
        `load_model`, vLLM and `model.name` accept as they are."""
        p = self._policy(policy)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(
            self.full_state_dict(policy), str(directory / MODEL_WEIGHTS), metadata={"format": "pt"}
        )
        causal_lm = _causal_lm(p.model)
        causal_lm.config.save_pretrained(str(directory))
        if causal_lm.generation_config is not None:
            causal_lm.generation_config.save_pretrained(str(directory))
        try:
            from masenvs.adapters.models import ModelLoadError, load_tokenizer

            load_tokenizer(p.base_name).save_pretrained(str(directory))
        except (ModelLoadError, OSError, ValueError):
            pass  # a custom base without a tokenizer on disk: the weights are what resume needs
        return directory

    def load_model(self, policy: str, directory: str | Path) -> None:
        """Load weights written by `save_model` into `policy` (same architecture required)."""
        self._policy(policy)  # a clear error for an unknown name
        path = Path(directory) / MODEL_WEIGHTS
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} does not exist; expected a model written by Learner.save_model"
            )
        state = load_file(str(path), device=str(self.device))
        self.set_full_state_dict(policy, state, where=str(directory))

    def set_full_state_dict(
        self, policy: str, state: dict[str, torch.Tensor], where: str = "state dict"
    ) -> None:
        """Copy `state` (keyed as `full_state_dict`) into a fully fine-tuned policy."""
        p = self._policy(policy)
        expected = self.full_state_dict(policy).keys() if not p.lora else set()
        if p.lora or set(state) != set(expected):
            missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
            raise ValueError(
                f"{where} does not fit policy {policy!r}: missing {missing[:3]}..., "
                f"unexpected {extra[:3]}... (a different base model, or a LoRA policy?)"
            )
        own = p.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in state.items():
                own[name].copy_(tensor)

    def save_adapter(self, policy: str, directory: str | Path) -> Path:
        """Write `adapter_config.json` + `adapter_model.safetensors` (peft and vLLM format)."""
        p = self._lora_policy(policy)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(
            self.adapter_state_dict(policy),
            str(directory / ADAPTER_WEIGHTS),
            metadata={"format": "pt"},
        )
        config = copy.deepcopy(p.model.peft_config[policy])
        config.inference_mode = True
        # The real base (a path or hub id), so peft and vLLM load the adapter elsewhere.
        config.base_model_name_or_path = model_reference(p.base_name)
        if self.cfg.lora.target_modules == "all-linear":
            # peft resolves 'all-linear' to full module paths; peft and vLLM both match names
            # by their last part, and the short list reads better.
            config.target_modules = sorted({m.rsplit(".", 1)[-1] for m in config.target_modules})
        config.save_pretrained(str(directory))
        return directory

    def load_adapter(self, policy: str, directory: str | Path) -> None:
        """Load weights written by `save_adapter` into `policy` (same LoRA shape required)."""
        p = self._lora_policy(policy)
        path = Path(directory) / ADAPTER_WEIGHTS
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} does not exist; expected an adapter written by save_adapter"
            )
        state = load_file(str(path), device=str(self.device))
        expected = set(get_peft_model_state_dict(p.model, adapter_name=policy))
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ValueError(
                f"adapter at {directory} does not fit policy {policy!r}: "
                f"missing {missing[:3]}..., unexpected {extra[:3]}... (different LoRA targets?)"
            )
        set_peft_model_state_dict(p.model, state, adapter_name=policy)

    def _lora_policy(self, policy: str) -> Policy:
        p = self._policy(policy)
        if not p.lora:
            raise ValueError(
                f"policy {policy!r} trains the whole model (policy.finetune: full); its "
                "weights are full_state_dict(policy) / save_model"
            )
        return p

    def state_dict(self) -> dict[str, Any]:
        """Optimizer states and the schedule position (weights: save_adapter / save_model)."""
        return {
            "steps_done": self.steps_done,
            "optimizers": {n: p.optimizer.state_dict() for n, p in self.policies.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state["optimizers"]) != set(self.policies):
            raise ValueError(
                f"checkpoint has policies {sorted(state['optimizers'])}, "
                f"this learner has {sorted(self.policies)}"
            )
        self.steps_done = int(state["steps_done"])
        for name, opt_state in state["optimizers"].items():
            self.policies[name].optimizer.load_state_dict(opt_state)


# ---------------------------------------------------------------------------------------------
# Log-probs from hidden states, chunk by chunk
# ---------------------------------------------------------------------------------------------


def token_logprobs(
    head: torch.nn.Module | None,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor,
    chunk_tokens: int,
    with_entropy: bool = False,
) -> _Scored:
    """log softmax(head(hidden) / T)[target] per row, `chunk_tokens` rows at a time.

    The fp32 logits [rows, vocab] are the largest tensor of a step (vocab 150k: 600 kB per
    token). Each chunk's logits exist only while that chunk is scored: with grad, the chunk
    runs under activation checkpointing, so the backward recomputes them chunk by chunk too
    and autograd never keeps them. `head=None` means `hidden` already is the logits.
    `temperature` is one number, or one per row ([rows, 1]) when agents sample at different
    temperatures.
    """
    grad = torch.is_grad_enabled() and hidden.requires_grad
    logprobs, raw, entropy = [], [], 0.0
    for begin in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[begin : begin + chunk_tokens], targets[begin : begin + chunk_tokens]
        temp = temperature
        if isinstance(temp, torch.Tensor):
            temp = temp[begin : begin + chunk_tokens]
        if grad:
            lp, logits = checkpoint(_chunk_logprobs, head, h, t, temp, use_reentrant=False)
        else:
            lp, logits = _chunk_logprobs(head, h, t, temp)
        with torch.no_grad():  # from the logits the chunk computed anyway; no graph
            if _is_one(temp):
                raw.append(lp.detach())
            else:
                raw.append(-F.cross_entropy(logits, t, reduction="none"))
            if with_entropy:
                z = logits if _is_one(temp) else logits / temp
                entropy += (
                    (torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)).sum().item()
                )
        del logits
        logprobs.append(lp)
    empty = hidden.new_zeros(0, dtype=torch.float32)
    return _Scored(
        logprobs=torch.cat(logprobs) if logprobs else empty,
        raw_logprobs=torch.cat(raw) if raw else empty,
        entropy_sum=entropy,
    )


def matmul_flops_per_s(n: int = 2048, repeats: int = 3) -> tuple[float, float]:
    """A large square fp32 `torch.mm` on this thread right now: (FLOP per second of wall
    time, best of `repeats`; FLOP per second of the process's CPU time, over all of them).

    The peak an update's MFU is measured against. On a shared machine the second is the
    steadier: time slices lost to other processes count in neither."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = math.inf
    cpu = time.process_time()
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    cpu = time.process_time() - cpu
    return 2 * n**3 / best, 2 * n**3 * repeats / max(cpu, 1e-9)


def mfu_metrics(update: dict[str, float]) -> dict[str, float]:
    """The update's MFU against a matmul timed now (call right after `Learner.step`, on its
    thread): per wall second, and per CPU second (steadier on a shared machine)."""
    wall, cpu = matmul_flops_per_s()
    out = {"learner/matmul_gflop_per_s": wall / 1e9, "learner/mfu": 0.0, "learner/mfu_cpu": 0.0}
    if update.get("learner/time_s"):
        out["learner/mfu"] = update["learner/gflops"] * 1e9 / update["learner/time_s"] / wall
    if update.get("learner/cpu_s"):
        out["learner/mfu_cpu"] = update["learner/gflops"] * 1e9 / update["learner/cpu_s"] / cpu
    return out


def linear_params(causal_lm: Any) -> int:
    """Weights of the decoder's linear layers (LoRA matrices and the LM head excluded)."""
    head = causal_lm.get_output_embeddings()
    return sum(
        m.weight.numel()
        for name, m in causal_lm.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not head and "lora_" not in name
    )


def forward_flops(config: Any, params: int, mb: MicroBatch) -> float:
    """Model FLOPs of one forward pass over `mb`: 2 per weight per real token, attention
    (q.k and the weighted sum of values: 4 x heads x head_dim per attended pair and layer) and
    the LM head on the scored positions only (padding is not counted)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    attention = 4 * heads * head_dim * text.num_hidden_layers * mb.attended
    head = 2 * text.hidden_size * text.vocab_size * mb.targets.numel()
    return 2.0 * params * mb.tokens + attention + head


def _is_one(temperature: float | torch.Tensor) -> bool:
    return not isinstance(temperature, torch.Tensor) and temperature == 1.0


def _chunk_logprobs(
    head: torch.nn.Module | None,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs at `temperature` with grad, the fp32 logits at T=1 without)."""
    logits = (head(hidden) if head is not None else hidden).float()
    scaled = logits if _is_one(temperature) else logits / temperature
    return -F.cross_entropy(scaled, targets, reduction="none"), logits.detach()


class _Mismatch:
    """|learner log-prob - backend log-prob| over completion tokens (same weights, T=1)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0
        self.max = 0.0

    def add(self, batch: Sequence[Sample], idx: Sequence[int], raw: Sequence[torch.Tensor]) -> None:
        for i, lp in zip(idx, raw, strict=True):
            # Kept per sample for the viewer (`masenvs ui` shows both, token by token).
            batch[i].meta["learner_logprobs"] = lp.cpu().tolist()
            behavior = batch[i].behavior_logprobs
            if not behavior:
                continue
            diff = (lp.cpu().double() - torch.tensor(behavior, dtype=torch.float64)).abs()
            self.total += diff.sum().item()
            self.count += diff.numel()
            self.max = max(self.max, diff.max().item())

    def means(self) -> dict[str, float]:
        if not self.count:
            return {}
        return {"logprob_diff_mean": self.total / self.count, "logprob_diff_max": self.max}


def _split(flat: torch.Tensor, batch: Sequence[Sample], idx: Sequence[int]) -> list[torch.Tensor]:
    sizes = [len(batch[i].completion_token_ids) for i in idx]
    return list(torch.split(flat.detach(), sizes))


def _gather(per_sample: list[torch.Tensor], idx: Sequence[int]) -> torch.Tensor:
    return torch.cat([per_sample[i] for i in idx])


def _causal_lm(model: Any) -> Any:
    """The transformers causal LM under a peft wrapper (or the model itself)."""
    return model.get_base_model() if isinstance(model, PeftModel) else model


def _has_dropout(model: Any) -> bool:
    """Whether a train-mode forward is random (LoRA dropout, a model's own dropout)."""
    config = _causal_lm(model).config
    if any(getattr(config, k, 0.0) for k in ("attention_dropout", "hidden_dropout", "dropout")):
        return True
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


def _plain_lm_head(config: Any) -> bool:
    """True when logits are exactly lm_head(hidden) (Llama, Qwen, Mistral, SmolLM ...)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scalers = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")
    return all(getattr(text, name, None) in (None, 1.0) for name in scalers)


def _custom_mask_ok(config: Any) -> bool:
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


def _mask_for(config: Any, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sdpa takes the boolean mask as is; eager attention adds a float mask to the scores."""
    if config._attn_implementation == "sdpa":
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, torch.finfo(dtype).min
    )


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "model.device is 'cuda' but no CUDA device is visible; use 'cpu' or 'auto'"
        )
    return torch.device(device)


def _resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
