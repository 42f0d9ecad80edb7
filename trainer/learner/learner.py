"""The learner: LoRA adapters or whole causal LMs, updated with the AT-GRPO loss.

One `Policy` = one adapter (or, with `policy.finetune: full`, one whole model) + its own
AdamW. The policy mode decides how they share weights: `shared` (one adapter on one base
model, or one model), `per_agent` (one adapter per agent on one base model, or one model
per agent; an agent's samples only ever touch its own weights), `separate` (one base model
and one adapter per agent). `Learner.step(samples)` is one training step for every policy.

The pieces live next door: `policies` (policy modes, models, optimizers), `packing`
(micro-batch planning), `scoring` (log-probs and the loss), `flops` (FLOPs and MFU),
`weights` (save and load), `parallel` (how a batch is shared with other processes).
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from masenvs.trainer.atgrpo import LossSums
from masenvs.trainer.config import TrainConfig
from masenvs.trainer.learner import flops, packing, policies, prefix, scoring, weights
from masenvs.trainer.learner.parallel import DataParallel, OneProcess, Scores
from masenvs.trainer.learner.policies import causal_lm_of, has_dropout
from masenvs.trainer.samples import Sample


class Learner:
    """Policies (LoRA adapters or whole models) and their optimizers; `step(samples)` runs
    one AT-GRPO update. `parallel` shares each batch with other processes (default: none)."""

    def __init__(
        self,
        cfg: TrainConfig,
        agents: Sequence[str],
        load_base: policies.ModelLoader = policies.load_base_model,
        parallel: DataParallel | None = None,
    ) -> None:
        self.cfg = cfg
        self.agents = list(agents)
        if not self.agents:
            raise ValueError("the learner needs at least one agent")
        self.parallel: DataParallel = parallel or OneProcess()
        self.full = cfg.policy.finetune == "full"
        self.device = policies.resolve_device(cfg.model.device)
        self.dtype = policies.resolve_dtype(cfg.model.dtype, self.device)
        # Full fine-tuning on a GPU with dtype 'auto': fp32 master weights (and AdamW state),
        # bf16 compute through autocast. Updates of lr ~1e-6 would mostly round away in bf16
        # weights; model.dtype: bfloat16 keeps them in bf16 anyway, for half the memory.
        self.autocast: torch.dtype | None = None
        if self.full and cfg.model.dtype == "auto" and self.dtype == torch.bfloat16:
            self.dtype, self.autocast = torch.float32, torch.bfloat16
        self.steps_done = 0  # the LR schedule's position: training steps completed
        self.flops = 0.0  # model FLOPs of the passes run so far (see `forward_flops`)
        self._linear_params: dict[int, int] = {}  # per causal LM: weights of its linear layers
        policies.check_policy_settings(cfg, self.agents)
        self.policies: dict[str, policies.Policy] = {}
        # Adapter init draws from torch's RNG: fork it so init depends on cfg.seed only.
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            torch.manual_seed(cfg.seed)
            # peft 0.21 reads a transformers attribute deprecated in 5.x; not actionable here.
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
            self.policies = policies.build_policies(
                cfg, self.agents, load_base, self.device, self.dtype
            )

    def policy_of(self, agent: str) -> str:
        return self.cfg.policy.policy_of(agent)

    def trains(self, policy: str) -> bool:
        """Whether `policy` is trained (False for frozen agents' policies)."""
        return not self.policy(policy).frozen

    def policy(self, name: str) -> policies.Policy:
        """The policy called `name` (a clear error for an unknown name)."""
        if name not in self.policies:
            raise KeyError(f"unknown policy {name!r}; policies are {sorted(self.policies)}")
        return self.policies[name]

    def lora_policy(self, name: str) -> policies.Policy:
        """The LoRA policy called `name` (a clear error when it trains the whole model)."""
        return weights.require_lora(self.policy(name))

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
            if self.policy(s.policy).frozen:
                continue
            if s.completion_token_ids:  # an empty completion has no token to train
                by_policy[s.policy].append(s)
        lr = self.cfg.optim.lr_at(self.steps_done, self.cfg.steps)
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

    def _update(self, policy: policies.Policy, batch: list[Sample], lr: float) -> dict[str, float]:
        algo = self.cfg.algorithm
        model = policy.model
        if policy.lora:
            model.set_adapter(policy.name)  # only this adapter is active and requires grad

        # pi_old: with a single optimizer step on this batch (the default), the update's own
        # forward runs at the current weights, so its detached log-probs *are* the old ones.
        # More steps (or dropout, which makes the train-mode forward differ) need a
        # separate no-grad pass first.
        one_step = algo.ppo_epochs * algo.optimizer_steps(len(batch)) == 1
        one_step = one_step and not has_dropout(model)
        old: list[torch.Tensor] | None = None
        ref: list[torch.Tensor] | None = None
        mismatch = scoring.Mismatch()
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
            seed = self.cfg.seed * 1_000_003 + self.steps_done * 1_009 + epoch
            parts = self.cfg.algorithm.optimizer_steps(len(batch))
            for part in packing.mini_batches(len(batch), parts, seed):
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
        mismatch: scoring.Mismatch | None,
        share: bool,
    ) -> None:
        """Backward of the token-mean loss of `batch[part]`, one micro-batch at a time (of
        this process's share of it, when `parallel` shares the batch with others)."""
        par = self.parallel
        sub = [batch[i] for i in part]
        num_tokens = sum(len(s.completion_token_ids) for s in sub)  # the token mean's N
        mine = [part[i] for i in par.assign(sub, share, self.cfg.optim.max_tokens_per_microbatch)]
        # Other processes: sum this one's share first, then over all of them.
        alone = par.world_size == 1
        own_sums = sums if alone else LossSums()
        own_mismatch = mismatch if alone or mismatch is None else scoring.Mismatch()
        causal_lm = causal_lm_of(model)
        shared = self._shared_prefix(model, causal_lm, [batch[i] for i in mine], share)
        passes = self._passes(
            self.microbatches([batch[i] for i in mine], share, shared.length if shared else 0),
            lambda: next(self.microbatches([batch[part[0]]], share)),
        )
        for mb, real, last in passes:
            par.gradient_sync(causal_lm, last)
            scored = self.forward(model, mb, self.cfg.logging.entropy, shared)
            if not real:  # a pass for the collectives only: no gradient
                (scored.logprobs.sum() * 0.0).backward()
                continue
            idx = [mine[i] for i in mb.samples]  # back to batch indices
            own_sums.add(
                scoring.microbatch_backward(
                    batch, idx, scored, old, ref, num_tokens, self.cfg.algorithm, self.device,
                    par.loss_scale,
                )
            )  # fmt: skip
            if own_mismatch is not None:  # this forward ran at the generating weights
                own_mismatch.add(
                    batch, idx, scoring.split_per_sample(scored.raw_logprobs, batch, idx)
                )
        if shared is not None:
            shared.backward()  # the micro-batches' gradients of the prefix's keys and values
        par.finish_gradients(model, causal_lm)
        if not alone:
            par.reduce(own_sums, own_mismatch)
            sums.add(own_sums)
            if mismatch is not None and own_mismatch is not None:
                mismatch.merge(own_mismatch)

    def _shared_prefix(
        self, model: Any, causal_lm: Any, batch: list[Sample], share: bool
    ) -> prefix.SharedPrefix | None:
        """Feed the prefix every prompt of `batch` starts with once (trainer/learner/prefix.py), where
        it is long enough, `optim.share_prefix` is on, prompts may be shared, one process
        holds the whole model, and no activation is recomputed. Without grad (the scoring
        passes of pi_old and the reference) the prefix is fed once and only attended to."""
        opt = self.cfg.optim
        if not (opt.share_prefix and share):
            return None
        if opt.gradient_checkpointing or self.parallel.world_size != 1 or self.parallel.lockstep:
            return None
        if self.parallel.root_forward or not scoring.plain_lm_head(causal_lm.config):
            return None
        if has_dropout(model):  # the prefix's forward runs twice and must give the same keys
            return None
        tokens = prefix.prefix_tokens(batch)
        if not tokens:
            return None
        backbone = getattr(causal_lm, causal_lm.base_model_prefix)
        pass_ = packing.prefix_pass(len(tokens))
        count = self._linear_params
        if torch.is_grad_enabled():  # forward and backward
            self.flops += flops.pass_flops(model, causal_lm, pass_, self.full, count)
        with torch.no_grad():  # the first, keys only
            self.flops += flops.pass_flops(model, causal_lm, pass_, self.full, count)
        return prefix.feed_prefix(backbone, tokens, self.device, self.autocast)

    def _passes(
        self, microbatches: Iterator[packing.MicroBatch], padding: Callable[[], packing.MicroBatch]
    ) -> Iterator[tuple[packing.MicroBatch, bool, bool]]:
        """(micro-batch, real, last pass). In lockstep every process runs as many passes:
        zero-weight `padding` micro-batches make up the difference."""
        if not self.parallel.lockstep:
            for mb in microbatches:
                yield mb, True, False
            return
        own = list(microbatches)
        total = self.parallel.max_passes(len(own))
        pad = padding() if total > len(own) else None
        for k in range(total):
            yield (own[k], True, k == total - 1) if k < len(own) else (pad, False, k == total - 1)

    # -- scoring ----------------------------------------------------------------------------

    @torch.no_grad()
    def logprobs(
        self, policy: str, samples: Sequence[Sample], base: bool = False
    ) -> list[torch.Tensor]:
        """Per-token log-probs of each sample's completion under the current weights (no grad).

        Each at the temperature it was sampled with; `base=True` scores with the base model
        (the adapter disabled, or the frozen reference copy of full fine-tuning).
        """
        return self._score(self.policy(policy), list(samples), base=base)[0]

    @torch.no_grad()
    def _score(
        self, policy: policies.Policy, batch: list[Sample], base: bool = False
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
        if not todo:
            return scored, raw
        sub = [batch[i] for i in todo]
        share = policy.share_prompts
        budget = self.cfg.optim.max_tokens_per_microbatch
        mine = [todo[i] for i in self.parallel.assign(sub, share, budget)]
        # The base model of a LoRA policy: the adapter stays off for every pass, the prefix's too.
        off = model.disable_adapter() if base and policy.lora else contextlib.nullcontext()
        with off:
            shared = self._shared_prefix(
                model, causal_lm_of(model), [batch[i] for i in mine], share
            )
            own = self._score_passes(model, batch, mine, todo, share, shared)
        for i, (lp, r) in self.parallel.gather_scores(own).items():
            scored[i], raw[i] = lp, r
        return scored, raw

    def _score_passes(
        self,
        model: Any,
        batch: list[Sample],
        mine: list[int],
        todo: list[int],
        share: bool,
        shared: prefix.SharedPrefix | None,
    ) -> Scores:
        """Each of `mine`'s log-probs (and raw ones) from no-grad passes over its micro-batches."""
        passes = self._passes(
            self.microbatches([batch[i] for i in mine], share, shared.length if shared else 0),
            lambda: next(self.microbatches([batch[todo[0]]], share)),
        )
        own: Scores = {}
        for mb, real, _ in passes:
            out = self.forward(model, mb, with_entropy=False, shared=shared)
            if not real:
                continue
            idx = [mine[j] for j in mb.samples]
            lps = scoring.split_per_sample(out.logprobs, batch, idx)
            raws = scoring.split_per_sample(out.raw_logprobs, batch, idx)
            for i, lp, r in zip(idx, lps, raws, strict=True):
                own[i] = (lp, r)
        return own

    def microbatches(
        self, batch: list[Sample], share: bool, prefix: int = 0
    ) -> Iterator[packing.MicroBatch]:
        """Prompt units packed into rows, rows into micro-batches within the token budget
        (less a `prefix` every prompt starts with, fed beforehand)."""
        budget = self.cfg.optim.max_tokens_per_microbatch
        units = packing.prompt_units(batch, share, budget, prefix)
        lengths = [packing.unit_length(batch, u, prefix) for u in units]
        for rows in packing.plan_microbatches(lengths, budget):
            rows_ = [[units[u] for u in row] for row in rows]
            mb = packing.build_microbatch(batch, rows_, prefix)
            samples = [batch[i] for i in mb.samples]
            mb.temperature = scoring.temperatures(samples, map(self.sample_temperature, samples))
            yield mb

    def sample_temperature(self, sample: Sample) -> float:
        """The temperature `sample` was drawn at, as its call recorded it; the agent's
        configured one (`agents.<name>`, else rollout's) where it is not known, or where the
        call was greedy (0: its tokens were drawn from no distribution to score)."""
        if sample.sampling is not None and sample.sampling.temperature > 0.0:
            return float(sample.sampling.temperature)
        return float(self.cfg.agent(sample.agent).temperature)

    def forward(
        self,
        model: Any,
        mb: packing.MicroBatch,
        with_entropy: bool,
        shared: prefix.SharedPrefix | None = None,
    ) -> scoring.Scored:
        """Log-probs of the micro-batch's completion tokens (grad follows the caller's mode);
        `shared` holds the keys and values of the `mb.prefix` tokens its prompts start with."""
        causal_lm = causal_lm_of(model)
        input_ids = mb.input_ids.to(self.device)
        position_ids = mb.position_ids.to(self.device)
        index = mb.score_index.to(self.device)
        targets = mb.targets.to(self.device)
        inputs: dict[str, Any] = {"input_ids": input_ids, "position_ids": position_ids}
        if mb.prefix:
            if shared is None or shared.length != mb.prefix:
                raise ValueError("a micro-batch packed after a prefix needs that prefix's cache")
            backbone = getattr(causal_lm, causal_lm.base_model_prefix)
            inputs[prefix.cache_argument(backbone)] = shared.cache(input_ids.shape[0])
        if mb.attention_mask is not None:  # shared prompts; else position ids delimit sequences
            mask = mb.attention_mask.to(self.device)
            inputs["attention_mask"] = scoring.mask_for(
                causal_lm.config, mask, self.autocast or self.dtype
            )
        self.flops += flops.pass_flops(model, causal_lm, mb, self.full, self._linear_params)
        temperature = mb.temperature
        if isinstance(temperature, torch.Tensor):
            temperature = temperature.to(self.device)
        with torch.autocast(self.device.type, self.autocast, enabled=self.autocast is not None):
            return scoring.score_tokens(
                causal_lm,
                inputs,
                index,
                targets,
                temperature,
                self.cfg.optim.logprob_chunk_tokens,
                with_entropy=with_entropy,
                through_head=not self.parallel.root_forward,
            )

    # -- weights out and in (see weights.py) ------------------------------------------------

    def adapter_state_dict(self, policy: str) -> dict[str, torch.Tensor]:
        """The adapter's weights as CPU copies, keyed as in peft's `adapter_model.safetensors`."""
        return weights.adapter_state_dict(self.lora_policy(policy))

    def full_state_dict(self, policy: str) -> dict[str, torch.Tensor]:
        """Every weight of a fully fine-tuned policy as CPU copies, keyed as in the base
        model's `model.safetensors` (`model.layers.0.self_attn.q_proj.weight`, ...).

        Tied weights appear once, under their first name (an LM head tied to the input
        embedding is `model.embed_tokens.weight` only), as `save_pretrained` writes them.
        """
        return weights.full_state_dict(self.policy(policy))

    def save_model(self, policy: str, directory: str | Path) -> Path:
        """Write a fully fine-tuned policy as a Hugging Face model directory (config,
        `model.safetensors` and, when it can be found, the base model's tokenizer), which
        `load_model`, vLLM and `model.name` accept as they are."""
        p = self.policy(policy)
        Path(directory).mkdir(parents=True, exist_ok=True)
        return weights.write_model(p, self.full_state_dict(policy), directory)

    def load_model(self, policy: str, directory: str | Path) -> None:
        """Load weights written by `save_model` into `policy` (same architecture required)."""
        self.policy(policy)  # a clear error for an unknown name
        state = weights.read_model(directory, self.device)
        self.set_full_state_dict(policy, state, where=str(directory))

    def set_full_state_dict(
        self, policy: str, state: dict[str, torch.Tensor], where: str = "state dict"
    ) -> None:
        """Copy `state` (keyed as `full_state_dict`) into a fully fine-tuned policy."""
        weights.set_full_state(self.policy(policy), state, where)

    def save_adapter(self, policy: str, directory: str | Path) -> Path:
        """Write `adapter_config.json` + `adapter_model.safetensors` (peft and vLLM format)."""
        p = self.lora_policy(policy)
        Path(directory).mkdir(parents=True, exist_ok=True)
        state = self.adapter_state_dict(policy)
        return weights.write_adapter(p, state, directory, self.cfg.lora.target_modules)

    def load_adapter(self, policy: str, directory: str | Path) -> None:
        """Load weights written by `save_adapter` into `policy` (same LoRA shape required)."""
        p = self.lora_policy(policy)
        weights.set_adapter_state(p, weights.read_adapter(directory, self.device), str(directory))

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
