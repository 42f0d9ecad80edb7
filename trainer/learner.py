"""The learner: LoRA adapters on a causal LM, updated with the AT-GRPO loss.

One `Policy` = one adapter + its own AdamW. The policy mode decides how they share weights:
`shared` (one adapter on one base model), `per_agent` (one adapter per agent on one base
model; an agent's samples only ever touch its adapter), `separate` (one base model and one
adapter per agent). `Learner.step(samples)` is one training step for every policy.
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

from masenvs.trainer.atgrpo import LossSums, policy_loss
from masenvs.trainer.config import OptimConfig, TrainConfig
from masenvs.trainer.samples import Sample

ModelLoader = Callable[[str, torch.device, torch.dtype], Any]
"""(model name, device, dtype) -> a transformers causal LM."""

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


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


def prompt_units(batch: Sequence[Sample], share: bool) -> list[Unit]:
    """Group samples with identical prompts (the K branches of a tree node have one prompt)."""
    if not share:
        return [[i] for i in range(len(batch))]
    units: dict[tuple[int, ...], Unit] = {}
    for i, s in enumerate(batch):
        units.setdefault(tuple(s.prompt_token_ids), []).append(i)
    return list(units.values())


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
    for r, row in enumerate(rows):
        o = 0  # where the current unit starts
        for unit in row:
            prompt = batch[unit[0]].prompt_token_ids
            p = len(prompt)
            input_ids[r, o : o + p] = torch.tensor(prompt)
            position_ids[r, o : o + p] = torch.arange(p)
            if mask is not None:
                mask[r, 0, o : o + p, o : o + p] = _causal(p)
            start = o + p  # where the current completion starts
            for i in unit:
                completion = batch[i].completion_token_ids
                n = len(completion) - 1
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
    )


def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


# ---------------------------------------------------------------------------------------------
# The learner
# ---------------------------------------------------------------------------------------------


@dataclass
class Policy:
    """One trainable adapter: the model that holds it, its parameters and its optimizer."""

    name: str
    model: PeftModel
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.AdamW
    base_name: str  # model the adapter sits on
    share_prompts: bool  # feed a prompt once for all samples that have it (see build_microbatch)


@dataclass
class _Scored:
    logprobs: torch.Tensor  # [n] at the training temperature; with grad in the update pass
    raw_logprobs: torch.Tensor  # [n] at T=1 (what backends report), no grad
    entropy_sum: float


class Learner:
    """LoRA policies and their optimizers; `step(samples)` runs one AT-GRPO update."""

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
        self.device = _resolve_device(cfg.model.device)
        self.dtype = _resolve_dtype(cfg.model.dtype, self.device)
        self.steps_done = 0  # the LR schedule's position: training steps completed
        unknown = sorted(set(cfg.policy.models) - set(self.agents))
        if unknown:
            raise ValueError(
                f"policy.models names agents {unknown} that are not in this env's agents {self.agents}"
            )
        self.policies: dict[str, Policy] = {}
        # Adapter init draws from torch's RNG: fork it so init depends on cfg.seed only.
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            torch.manual_seed(cfg.seed)
            # peft 0.21 reads a transformers attribute deprecated in 5.x; not actionable here.
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
            self._build(load_base)

    # -- construction -----------------------------------------------------------------------

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
        if mode == "separate":
            for agent in self.agents:
                base_name = self.cfg.policy.models.get(agent, self.cfg.model.name)
                base = load_base(base_name, self.device, self.dtype)
                model = get_peft_model(base, self._lora_config(), adapter_name=agent)
                self._add_policy(agent, model, base_name)
            return
        base = load_base(self.cfg.model.name, self.device, self.dtype)
        model = get_peft_model(base, self._lora_config(), adapter_name=names[0])
        for name in names[1:]:
            model.add_adapter(name, self._lora_config())
        for name in names:
            self._add_policy(name, model, self.cfg.model.name)

    def _add_policy(self, name: str, model: PeftModel, base_name: str) -> None:
        params: list[torch.nn.Parameter] = []
        for module in model.modules():
            if isinstance(module, LoraLayer) and name in module.lora_A:
                params += list(module.lora_A[name].parameters())
                params += list(module.lora_B[name].parameters())
        if not params:
            raise ValueError(
                f"LoRA target_modules {self.cfg.lora.target_modules!r} matched no layer of {base_name}"
            )
        opt = self.cfg.optim
        optimizer = torch.optim.AdamW(
            params, lr=opt.lr, betas=opt.betas, eps=opt.adam_eps, weight_decay=opt.weight_decay
        )
        share = self.cfg.optim.share_prompts and _custom_mask_ok(model.get_base_model().config)
        self.policies[name] = Policy(name, model, params, optimizer, base_name, share)

    def policy_of(self, agent: str) -> str:
        return self.cfg.policy.policy_of(agent)

    def _policy(self, name: str) -> Policy:
        if name not in self.policies:
            raise KeyError(f"unknown policy {name!r}; policies are {sorted(self.policies)}")
        return self.policies[name]

    # -- one training step ------------------------------------------------------------------

    def step(self, samples: list[Sample]) -> dict[str, float]:
        """Update every policy on its own samples (which carry advantages); returns metrics.

        Policies without samples this step keep their weights, but the LR schedule of every
        policy advances: it counts training steps.
        """
        start = time.perf_counter()
        by_policy: dict[str, list[Sample]] = defaultdict(list)
        for s in samples:
            if s.advantage is None:
                raise ValueError(
                    "samples need advantages: run group_advantages(samples, cfg) first"
                )
            self._policy(s.policy)
            if s.completion_token_ids:  # an empty completion has no token to train
                by_policy[s.policy].append(s)
        lr = lr_at(self.steps_done, self.cfg.optim, self.cfg.steps)
        metrics: dict[str, float] = {"learner/lr": lr}
        tokens = 0
        for name, policy in self.policies.items():
            if by_policy.get(name):
                for key, value in self._update(policy, by_policy[name], lr).items():
                    metrics[f"learner/{name}/{key}"] = value
                tokens += sum(s.num_tokens for s in by_policy[name])
        self.steps_done += 1
        elapsed = time.perf_counter() - start
        metrics["learner/time_s"] = elapsed
        metrics["learner/tokens_per_s"] = tokens / elapsed if elapsed > 0 else 0.0
        return metrics

    def _update(self, policy: Policy, batch: list[Sample], lr: float) -> dict[str, float]:
        algo = self.cfg.algorithm
        model = policy.model
        model.set_adapter(policy.name)  # only this adapter is active and requires grad

        # pi_old: with a single optimizer step on this batch (the default), the update's own
        # forward runs at the current weights, so its detached log-probs *are* the old ones.
        # More steps (or LoRA dropout, which makes the train-mode forward differ) need a
        # separate no-grad pass first.
        one_step = algo.ppo_epochs * algo.mini_batches == 1 and self.cfg.lora.dropout == 0.0
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
        out["samples"] = float(len(batch))
        out["advantage_mean"] = sum(s.advantage or 0.0 for s in batch) / len(batch)
        out.update(mismatch.means())
        return out

    def _accumulate_gradients(
        self,
        model: PeftModel,
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
        """Split batch indices into `mini_batches` parts; shuffled (seeded by step and epoch)."""
        parts = self.cfg.algorithm.mini_batches
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

        At the training temperature; `base=True` scores with the adapter disabled.
        """
        return self._score(self._policy(policy), list(samples), base=base)[0]

    @torch.no_grad()
    def _score(
        self, policy: Policy, batch: list[Sample], base: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        model = policy.model
        model.set_adapter(policy.name)
        model.eval()
        empty = torch.zeros(0, device=self.device)
        scored = [empty] * len(batch)
        raw = [empty] * len(batch)
        todo = [i for i, s in enumerate(batch) if s.completion_token_ids]
        sub = [batch[i] for i in todo]
        for mb in self._microbatches(sub, policy.share_prompts):
            if base:
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
        units = prompt_units(batch, share)
        lengths = [unit_length(batch, u) for u in units]
        for rows in plan_microbatches(lengths, self.cfg.optim.max_tokens_per_microbatch):
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

    def _forward(self, model: PeftModel, mb: MicroBatch, with_entropy: bool) -> _Scored:
        """Log-probs of the micro-batch's completion tokens (grad follows the caller's mode)."""
        causal_lm = model.get_base_model()
        input_ids = mb.input_ids.to(self.device)
        position_ids = mb.position_ids.to(self.device)
        index = mb.score_index.to(self.device)
        targets = mb.targets.to(self.device)
        inputs: dict[str, Any] = {"input_ids": input_ids, "position_ids": position_ids}
        if mb.attention_mask is not None:  # shared prompts; else position ids delimit sequences
            mask = mb.attention_mask.to(self.device)
            inputs["attention_mask"] = _mask_for(causal_lm.config, mask, self.dtype)
        if _plain_lm_head(causal_lm.config):
            # Project only the positions that predict completion tokens: the LM head is a big
            # matmul, and prompt positions would be thrown away.
            backbone = getattr(causal_lm, causal_lm.base_model_prefix)
            hidden = backbone(**inputs, use_cache=False).last_hidden_state
            hidden = hidden.reshape(-1, hidden.shape[-1])[index]
            logits = causal_lm.get_output_embeddings()(hidden)
        else:  # heads with soft-capping or scaling: let the model apply them
            logits = causal_lm(**inputs, use_cache=False).logits
            logits = logits.reshape(-1, logits.shape[-1])[index]
        logits = logits.float()
        temperature = mb.temperature
        plain = isinstance(temperature, float) and temperature == 1.0
        if isinstance(temperature, torch.Tensor):
            temperature = temperature.to(self.device)
        scaled = logits if plain else logits / temperature
        logprobs = -F.cross_entropy(scaled, targets, reduction="none")
        with torch.no_grad():
            if plain:
                raw = logprobs.detach()
            else:
                raw = -F.cross_entropy(logits.detach(), targets, reduction="none")
            entropy = 0.0
            if with_entropy:
                z = scaled.detach()
                entropy = (torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)).sum().item()
        return _Scored(logprobs=logprobs, raw_logprobs=raw, entropy_sum=entropy)

    # -- weights out and in -----------------------------------------------------------------

    def adapter_state_dict(self, policy: str) -> dict[str, torch.Tensor]:
        """The adapter's weights as CPU copies, keyed as in peft's `adapter_model.safetensors`."""
        p = self._policy(policy)
        state = get_peft_model_state_dict(p.model, adapter_name=policy)
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}

    def save_adapter(self, policy: str, directory: str | Path) -> Path:
        """Write `adapter_config.json` + `adapter_model.safetensors` (peft and vLLM format)."""
        p = self._policy(policy)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(
            self.adapter_state_dict(policy),
            str(directory / ADAPTER_WEIGHTS),
            metadata={"format": "pt"},
        )
        config = copy.deepcopy(p.model.peft_config[policy])
        config.inference_mode = True
        config.base_model_name_or_path = p.base_name
        if self.cfg.lora.target_modules == "all-linear":
            # peft resolves 'all-linear' to full module paths; peft and vLLM both match names
            # by their last part, and the short list reads better.
            config.target_modules = sorted({m.rsplit(".", 1)[-1] for m in config.target_modules})
        config.save_pretrained(str(directory))
        return directory

    def load_adapter(self, policy: str, directory: str | Path) -> None:
        """Load weights written by `save_adapter` into `policy` (same LoRA shape required)."""
        p = self._policy(policy)
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

    def state_dict(self) -> dict[str, Any]:
        """Optimizer states and the schedule position (adapters are saved with save_adapter)."""
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


class _Mismatch:
    """|learner log-prob - backend log-prob| over completion tokens (same weights, T=1)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0
        self.max = 0.0

    def add(self, batch: Sequence[Sample], idx: Sequence[int], raw: Sequence[torch.Tensor]) -> None:
        for i, lp in zip(idx, raw, strict=True):
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
