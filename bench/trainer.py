"""Update-step throughput: masenvs `Learner.step` against TRL's `GRPOTrainer`, side by side.

Both compute the same loss (token-level PPO-clip, clip range [1-0.2, 1+0.28], token mean over
the batch, no KL, no dual clip) on the same model, LoRA config and batch, and take one AdamW
step with gradient clipping. Generation is excluded: TRL gets a prepared batch (prompt ids
left-padded, completion ids right-padded, advantages), as its `_generate_and_score_completions`
would hand to `compute_loss`; the timed region is compute_loss + backward + clip + step.
masenvs times `Learner.step(samples)` (packing included).

Two batches: `uniform` (every sequence prompt + completion of the same length) and `varied`
(the same total tokens, uneven prompt and completion lengths, as RL batches are).

MFU counts useful FLOPs only: LoRA training = forward + activation-gradient backward (frozen
weights get no weight gradient), i.e. 2 x forward; forward = 2 x linear params x tokens
+ causal attention (2 L^2 d per layer per sequence) + LM head on completion tokens only
(2 H V per completion token). Peak = a large fp32 torch.mm timed in the same run.

    python bench/trainer.py                        # SmolLM2-135M, 8 x 256 tokens, 3 repeats
    python bench/trainer.py --model tiny --repeats 2
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from masenvs.trainer.atgrpo import group_advantages
from masenvs.trainer.config import TrainConfig, load_config
from masenvs.trainer.learner import Learner
from masenvs.trainer.samples import Sample, tree_group

CLIP_LOW, CLIP_HIGH = 0.2, 0.28


@dataclass
class Result:
    name: str
    times: list[float]
    tokens: int
    flops: float

    @property
    def best(self) -> float:
        return min(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    """fp32 FLOP/s of a large square torch.mm on this machine right now."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def load_base(name: str) -> tuple[Any, Any]:
    """(model, tokenizer): via masenvs' model loader, or a same-shaped random SmolLM2."""
    from masenvs.adapters.models import load_model, load_tokenizer

    try:
        loaded = load_model(name)
        return loaded.model, loaded.tokenizer
    except Exception as exc:  # no GGUF package: same shapes, random weights
        from transformers import LlamaConfig, LlamaForCausalLM

        print(f"({name} unavailable: {exc}; using a random model of SmolLM2-135M's shape)")
        config = LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
            rope_theta=100000.0, max_position_embeddings=8192,
        )  # fmt: skip
        return LlamaForCausalLM(config).eval(), load_tokenizer("tiny")


def make_batch(kind: str, n: int, seq: int, vocab: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for k in range(n):
        if kind == "uniform":
            p = c = seq // 2
        else:  # varied: the same mean length, uneven split and total
            total = rng.randint(seq // 4, seq * 7 // 4)
            p = rng.randint(total // 8, total * 7 // 8)
            c = max(1, total - p)
        prompt = [rng.randrange(vocab) for _ in range(p)]
        completion = [rng.randrange(vocab) for _ in range(c)]
        samples.append(
            Sample(
                prompt,
                completion,
                [],
                "agent",
                "agent",
                tree_group(k // 4, 0, "agent"),
                float(k % 2),
            )
        )
    return samples


def useful_flops(model: Any, samples: list[Sample], lora_params: int) -> float:
    cfg = model.config
    linear = sum(
        m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)
    )
    tokens = sum(s.num_tokens for s in samples)
    completion = sum(len(s.completion_token_ids) for s in samples)
    attention = sum(2 * s.num_tokens**2 * cfg.hidden_size * cfg.num_hidden_layers for s in samples)
    forward = 2 * (linear + lora_params) * tokens + attention
    forward += 2 * cfg.hidden_size * cfg.vocab_size * completion
    return 2 * forward  # backward through frozen weights: activation gradients only


def bench_masenvs(
    base: Any, samples: list[Sample], cfg: TrainConfig, warmup: int, repeats: int
) -> tuple[list[float], Learner]:
    learner = Learner(cfg, ["agent"], lambda *_: copy.deepcopy(base))
    batch = group_advantages(samples, cfg.algorithm)[0]
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        learner.step(batch)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times, learner


def trl_trainer(base: Any, tokenizer: Any, cfg: TrainConfig, n: int, max_completion: int) -> Any:
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
        per_device_train_batch_size=n,
        num_generations=n,
        max_completion_length=max_completion,
        loss_type="dapo",  # token mean over the batch, as masenvs
        epsilon=CLIP_LOW,
        epsilon_high=CLIP_HIGH,
        beta=0.0,
        temperature=1.0,
        learning_rate=cfg.optim.lr,
        max_grad_norm=cfg.optim.grad_clip,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        report_to=[],
        disable_dropout=True,
    )
    lora = LoraConfig(
        r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=0.0,
        target_modules="all-linear", bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=copy.deepcopy(base),
            reward_funcs=lambda completions, **_: [0.0] * len(completions),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["x"] * n}),
            peft_config=lora,
            processing_class=tokenizer,
        )
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which we skip
    return trainer


def trl_inputs(samples: list[Sample], pad: int) -> dict[str, torch.Tensor]:
    """The batch GRPOTrainer builds after generation: left-padded prompts, right-padded completions."""
    p_max = max(len(s.prompt_token_ids) for s in samples)
    c_max = max(len(s.completion_token_ids) for s in samples)
    n = len(samples)
    prompt_ids = torch.full((n, p_max), pad)
    prompt_mask = torch.zeros(n, p_max, dtype=torch.long)
    completion_ids = torch.full((n, c_max), pad)
    completion_mask = torch.zeros(n, c_max, dtype=torch.long)
    for i, s in enumerate(samples):
        p, c = len(s.prompt_token_ids), len(s.completion_token_ids)
        prompt_ids[i, p_max - p :] = torch.tensor(s.prompt_token_ids)
        prompt_mask[i, p_max - p :] = 1
        completion_ids[i, :c] = torch.tensor(s.completion_token_ids)
        completion_mask[i, :c] = 1
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        "num_items_in_batch": completion_mask.sum(),
    }


def trl_step(
    trainer: Any,
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    inputs: dict[str, Any],
    max_norm: float,
) -> float:
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def bench_trl(
    trainer: Any, samples: list[Sample], cfg: TrainConfig, pad: int, warmup: int, repeats: int
) -> list[float]:
    model = trainer.model
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = cfg.optim
    optimizer = torch.optim.AdamW(
        params, lr=opt.lr, betas=opt.betas, eps=opt.adam_eps, weight_decay=opt.weight_decay
    )
    batch = group_advantages(samples, cfg.algorithm)[0]
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        trl_step(trainer, optimizer, params, trl_inputs(batch, pad), opt.grad_clip or float("inf"))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def same_gradient_check(
    learner: Learner, trainer: Any, samples: list[Sample], cfg: TrainConfig, pad: int
) -> tuple[float, float]:
    """Load masenvs' adapter into TRL's model and compare gradient norms on one batch."""
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(
        trainer.model, learner.adapter_state_dict("agent"), adapter_name="default"
    )
    batch = group_advantages(samples, cfg.algorithm)[0]
    trainer.model.train()
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    loss = trainer.compute_loss(trainer.model, trl_inputs(batch, pad))
    loss.backward()
    trl_norm = float(torch.nn.utils.clip_grad_norm_(params, float("inf")))
    trainer.model.zero_grad(set_to_none=True)
    metrics = learner.step(batch)  # reports the gradient norm before clipping
    return metrics["learner/agent/grad_norm"], trl_norm


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=256, help="mean tokens per sequence")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--kinds", default="uniform,varied")
    args = parser.parse_args()

    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    peak = matmul_peak()
    print(f"fp32 matmul peak (2048^3 torch.mm): {peak / 1e9:.1f} GFLOP/s")
    base, tokenizer = load_base(args.model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    vocab = base.config.vocab_size
    cfg = load_config(
        None,
        [
            f"model.name={args.model}",
            "lora.rank=8", "lora.alpha=16", "lora.dropout=0.0",
            f"algorithm.clip_low={CLIP_LOW}", f"algorithm.clip_high={CLIP_HIGH}",
            "algorithm.clip_c=null", "algorithm.kl_coef=0.0",
            "optim.warmup_steps=0", "optim.lr=1e-5",
            f"optim.max_tokens_per_microbatch={args.batch * args.seq * 2}",  # one micro-batch, as TRL
            "model.device=cpu" if not torch.cuda.is_available() else "model.device=auto",
        ],
    )  # fmt: skip

    rows = []
    for kind in args.kinds.split(","):
        samples = make_batch(kind, args.batch, args.seq, vocab)
        ours, learner = bench_masenvs(base, samples, cfg, args.warmup, args.repeats)
        lora_params = sum(p.numel() for p in learner.policies["agent"].params)
        flops = useful_flops(base, samples, lora_params)
        tokens = sum(s.num_tokens for s in samples)
        trainer = trl_trainer(
            base, tokenizer, cfg, args.batch, max(len(s.completion_token_ids) for s in samples)
        )
        g_ours, g_trl = same_gradient_check(learner, trainer, samples, cfg, pad)
        theirs = bench_trl(trainer, samples, cfg, pad, args.warmup, args.repeats)
        padded = len(samples) * (
            max(len(s.prompt_token_ids) for s in samples)
            + max(len(s.completion_token_ids) for s in samples)
        )
        print(f"\n[{kind}] {len(samples)} sequences, {tokens} tokens ({padded} padded for TRL); "
              f"same-weights grad norm: masenvs {g_ours:.6g}, TRL {g_trl:.6g}")  # fmt: skip
        rows.append(
            (
                kind,
                Result("masenvs Learner", ours, tokens, flops),
                Result("TRL GRPOTrainer", theirs, tokens, flops),
            )
        )
        del learner, trainer

    print(
        f"\n{'batch':8} {'system':17} {'step s (med)':>12} {'best':>7} {'tokens/s':>9} {'MFU':>6} {'speedup':>8}"
    )
    for kind, ours, theirs in rows:
        for r in (ours, theirs):
            speed = theirs.median / r.median
            mfu = r.flops / r.median / peak
            print(
                f"{kind:8} {r.name:17} {r.median:12.2f} {r.best:7.2f} {r.tokens / r.median:9.0f} {mfu:6.1%} {speed:7.2f}x"
            )
    print("\nFigures are provisional on a shared CPU; rerun on an idle machine for stable numbers.")


if __name__ == "__main__":
    main()
