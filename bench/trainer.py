"""Update-step throughput: masenvs `Learner.step` against TRL's `GRPOTrainer`, side by side.

Both compute the same loss (token-level PPO-clip, clip range [1-0.2, 1+0.28], token mean over
the batch, no KL, no dual clip) on the same model, LoRA config and batch, and take one AdamW
step with gradient clipping. Generation is excluded: TRL gets a prepared batch (prompt ids
left-padded, completion ids right-padded, advantages), as its `_generate_and_score_completions`
would hand to `compute_loss`; the timed region is compute_loss + backward + clip + step.
masenvs times `Learner.step(samples)` (packing included). Each system runs in its own fresh
process, one after the other; both start from the same LoRA weights, and their first step's
gradient norms are printed side by side to show that they compute the same loss.

Batches (8 sequences of 256 tokens on average):
  uniform   2 prompts x 4 completions (a GRPO batch: K completions per prompt), 128 + 128
  varied    2 prompts x 4 completions, uneven prompt and completion lengths
  distinct  8 different prompts, 128 + 128: nothing to share, the worst case for masenvs

Wall time on a shared machine swings with the load, so the table also gives process CPU time
(all threads), which other processes disturb far less; speedups are given on both.

MFU = model FLOPs / wall time / peak. Model FLOPs count the tokens each system feeds (masenvs
feeds a shared prompt once; padding excluded): LoRA training = forward + activation-gradient
backward (frozen weights get no weight gradient) = 2 x forward; forward = 2 x (linear + LoRA
params) x tokens + causal attention (2 L^2 d per layer and sequence) + the LM head on
completion tokens (what the loss needs; TRL's extra LM-head work is not counted). Peak = a
large fp32 torch.mm timed in the same run.

    python bench/trainer.py                        # SmolLM2-135M, 3 repeats, all batches
    python bench/trainer.py --model tiny --repeats 2 --kinds uniform
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from masenvs.cache import DEFAULT_MODEL
from masenvs.trainer.atgrpo import group_advantages
from masenvs.trainer.config import TrainConfig, load_config
from masenvs.trainer.learner.learner import Learner
from masenvs.trainer.samples import Sample, tree_group

CLIP_LOW, CLIP_HIGH = 0.2, 0.28


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
    from masenvs.engine.loading import load_model, load_tokenizer

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
    k = 1 if kind == "distinct" else 4  # completions per prompt
    samples = []
    for g in range(n // k):
        p = seq // 2 if kind != "varied" else rng.randint(seq // 8, seq)
        prompt = [rng.randrange(vocab) for _ in range(p)]
        for b in range(k):
            c = seq // 2 if kind != "varied" else rng.randint(seq // 8, seq * 3 // 2)
            completion = [rng.randrange(vocab) for _ in range(c)]
            group = tree_group(g // 4 if k == 1 else g, 0, "agent")  # groups of four
            reward = float((g + b) % 2)
            samples.append(Sample(prompt, completion, [], "agent", "agent", group, reward))
    return samples


def useful_flops(model: Any, samples: list[Sample], lora_params: int, share: bool) -> float:
    """Model FLOPs of one update on `samples` (see the module docstring)."""
    cfg = model.config
    linear = sum(
        m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)
    )
    prompts = {tuple(s.prompt_token_ids) for s in samples} if share else None
    prompt_tokens = (
        sum(len(p) for p in prompts) if share else sum(len(s.prompt_token_ids) for s in samples)
    )
    completion = sum(len(s.completion_token_ids) for s in samples)
    d, layers = cfg.hidden_size, cfg.num_hidden_layers
    # causal attention: a completion token attends to its prompt and its own earlier tokens
    attention = 0
    for s in samples:
        p, c = len(s.prompt_token_ids), len(s.completion_token_ids)
        attention += 4 * d * layers * (p * c + c * c / 2)
    for p in prompts if share else (tuple(s.prompt_token_ids) for s in samples):
        attention += 4 * d * layers * len(p) ** 2 / 2
    forward = 2 * (linear + lora_params) * (prompt_tokens + completion) + attention
    forward += 2 * d * cfg.vocab_size * completion
    return 2 * forward


def masenvs_worker(args: argparse.Namespace) -> dict[str, Any]:
    base, _ = load_base(args.model)
    cfg = bench_config(args)
    samples = make_batch(args.kind, args.batch, args.seq, base.config.vocab_size)
    learner = Learner(cfg, ["agent"], lambda *_: base)
    learner.save_adapter("agent", args.adapter)  # the TRL worker starts from these weights
    batch = group_advantages(samples, cfg.algorithm)[0]
    times, cpu, norms = [], [], []
    for _ in range(args.warmup + args.repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        metrics = learner.step(batch)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        norms.append(metrics["learner/agent/grad_norm"])
    lora_params = sum(p.numel() for p in learner.policies["agent"].params)
    share = learner.policies["agent"].share_prompts
    return {
        "times": times[args.warmup :],
        "cpu": cpu[args.warmup :],
        "grad_norm": norms[0],
        "tokens": sum(s.num_tokens for s in samples),
        "trl_padded_tokens": len(samples)
        * (
            max(len(s.prompt_token_ids) for s in samples)
            + max(len(s.completion_token_ids) for s in samples)
        ),
        "flops": useful_flops(base, samples, lora_params, share),
        "trl_flops": useful_flops(base, samples, lora_params, share=False),
    }


def bench_config(args: argparse.Namespace) -> TrainConfig:
    return load_config(
        None,
        [
            f"model.name={args.model}",
            "lora.rank=8", "lora.alpha=16", "lora.dropout=0.0",
            f"algorithm.clip_low={CLIP_LOW}", f"algorithm.clip_high={CLIP_HIGH}",
            "algorithm.clip_c=null", "algorithm.kl_coef=0.0",
            "optim.warmup_steps=0", "optim.lr=1e-5",
            f"optim.max_tokens_per_microbatch={args.batch * args.seq * 2}",  # one micro-batch, as TRL
            "model.device=auto",
        ],
    )  # fmt: skip


def trl_trainer(
    base: Any, tokenizer: Any, cfg: TrainConfig, n: int, max_completion: int, output_dir: str
) -> Any:
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation notices from transformers' TrainingArguments
        args = _grpo_config(GRPOConfig, cfg, n, max_completion, output_dir)
    lora = LoraConfig(
        r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=0.0,
        target_modules="all-linear", bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=base,
            reward_funcs=lambda completions, **_: [0.0] * len(completions),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["x"] * n}),
            peft_config=lora,
            processing_class=tokenizer,
        )
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which we skip
    return trainer


def _grpo_config(
    GRPOConfig: Any, cfg: TrainConfig, n: int, max_completion: int, output_dir: str
) -> Any:
    return GRPOConfig(
        output_dir=output_dir,  # nothing is saved; inside the bench's temp dir
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


def trl_worker(args: argparse.Namespace) -> dict[str, Any]:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    base, tokenizer = load_base(args.model)
    cfg = bench_config(args)
    samples = make_batch(args.kind, args.batch, args.seq, base.config.vocab_size)
    batch = group_advantages(samples, cfg.algorithm)[0]
    max_completion = max(len(s.completion_token_ids) for s in samples)
    out_dir = str(Path(args.adapter).parent / "trl-output")
    trainer = trl_trainer(base, tokenizer, cfg, args.batch, max_completion, out_dir)
    weights = load_file(f"{args.adapter}/adapter_model.safetensors")
    set_peft_model_state_dict(trainer.model, weights, adapter_name="default")
    model = trainer.model
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = cfg.optim
    optimizer = torch.optim.AdamW(
        params, lr=opt.lr, betas=opt.betas, eps=opt.adam_eps, weight_decay=opt.weight_decay
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    times, cpu, norms = [], [], []
    for _ in range(args.warmup + args.repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        inputs = trl_inputs(batch, pad)
        norms.append(trl_step(trainer, optimizer, params, inputs, opt.grad_clip or math.inf))
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"times": times[args.warmup :], "cpu": cpu[args.warmup :], "grad_norm": norms[0]}


def run_worker(system: str, kind: str, adapter: Path, args: argparse.Namespace) -> dict[str, Any]:
    out = adapter.parent / f"{system}-{kind}.json"
    command = [
        sys.executable, __file__, "--worker", system, "--kind", kind, "--adapter", str(adapter),
        "--out", str(out), "--model", args.model, "--batch", str(args.batch),
        "--seq", str(args.seq), "--repeats", str(args.repeats), "--warmup", str(args.warmup),
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{system} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=256, help="mean tokens per sequence")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--kinds", default="uniform,varied,distinct")
    parser.add_argument("--worker", choices=["masenvs", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--adapter", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        torch.manual_seed(0)
        result = (masenvs_worker if args.worker == "masenvs" else trl_worker)(args)
        Path(args.out).write_text(json.dumps(result))
        return

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, model {args.model}")
    peak = matmul_peak()
    print(f"fp32 matmul peak (2048^3 torch.mm): {peak / 1e9:.1f} GFLOP/s")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        for kind in args.kinds.split(","):
            adapter = Path(tmp) / kind / "adapter"
            ours = run_worker("masenvs", kind, adapter, args)
            theirs = run_worker("trl", kind, adapter, args)
            print(
                f"[{kind}] {args.batch} sequences, {ours['tokens']} tokens "
                f"({ours['trl_padded_tokens']} padded for TRL); first-step grad norm from the "
                f"same weights: masenvs {ours['grad_norm']:.6g}, TRL {theirs['grad_norm']:.6g}"
            )
            rows.append((kind, ours, theirs))

    header = (
        f"{'batch':9}{'system':17}{'wall s':>8}{'best':>7}{'cpu s':>8}{'tokens/s':>10}{'MFU':>7}"
    )
    print(f"\n{header}{'speedup wall':>14}{'speedup cpu':>13}")
    for kind, ours, theirs in rows:
        trl_wall, trl_cpu = statistics.median(theirs["times"]), statistics.median(theirs["cpu"])
        systems = (
            ("masenvs Learner", ours, ours["flops"]),
            ("TRL GRPOTrainer", theirs, ours["trl_flops"]),
        )
        for name, r, flops in systems:
            wall, cpu = statistics.median(r["times"]), statistics.median(r["cpu"])
            print(
                f"{kind:9}{name:17}{wall:8.2f}{min(r['times']):7.2f}{cpu:8.2f}"
                f"{ours['tokens'] / wall:10.0f}{flops / wall / peak:7.1%}"
                f"{trl_wall / wall:13.2f}x{trl_cpu / cpu:12.2f}x"
            )
    print("\nMedians of the timed steps. Figures are provisional on a shared CPU.")


if __name__ == "__main__":
    main()
