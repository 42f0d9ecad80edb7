"""Embedded engine vs Hugging Face `generate`: aggregate tokens/s at several batch sizes.

Both sides run in this one process on the same model, prompts and thread count, sample
at temperature 1 and generate exactly `--max-tokens` tokens per sequence (EOS ignored),
prefill included. Run:

    python bench/engine.py --model smollm2-135m --threads 2 --batches 1 8 32
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from masenvs.adapters.backends.base import GenerateRequest, SamplingParams
from masenvs.adapters.backends.embedded import EmbeddedBackend
from masenvs.adapters.models import load_model

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one paragraph.",
    "List three prime numbers greater than 50.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Give me a recipe for pancakes.",
    "Translate 'good morning' into Spanish.",
]


def prompts(count: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"}]
        for i in range(count)
    ]


@dataclass
class Rate:
    tokens: int
    wall_s: float
    cpu_s: float  # process CPU time, all threads: less sensitive to other load on the machine


def hf_generate(loaded, batch: list[list[dict[str, str]]], max_tokens: int) -> Rate:
    """Tokens/s of one `model.generate` call over the batch (left-padded)."""
    tokenizer = loaded.tokenizer
    tokenizer.padding_side = "left"
    texts = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in batch
    ]
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    start, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        output = loaded.model.generate(
            **inputs,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert output.shape[1] - inputs["input_ids"].shape[1] == max_tokens
    return Rate(len(batch) * max_tokens, elapsed, cpu)


def embedded_generate(
    backend: EmbeddedBackend, batch: list[list[dict[str, str]]], max_tokens: int
) -> float:
    """Tokens/s of the engine serving the batch as concurrent requests."""
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)

    async def serve() -> Rate:
        start, cpu = time.perf_counter(), time.process_time()
        generations = await asyncio.gather(
            *(backend.generate(GenerateRequest(model="", params=params, messages=m)) for m in batch)
        )
        elapsed, cpu_used = time.perf_counter() - start, time.process_time() - cpu
        produced = sum(len(g.completions[0].token_ids) for g in generations)
        assert produced == len(batch) * max_tokens
        return Rate(produced, elapsed, cpu_used)

    return asyncio.run(serve())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true", help="engine only (no baseline ratio)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    backend = EmbeddedBackend(loaded, max_batch_size=max(args.batches))
    embedded_generate(backend, prompts(2), 4)  # warm-up: allocate the cache, load kernels
    title = f"{args.model} on {args.device} ({loaded.dtype}, {args.threads} threads, {args.max_tokens} new tokens)"
    table = Table(title=title)
    for column in ("mode", "batch", "tokens/s (median)", "vs HF generate", "tokens per CPU-s"):
        table.add_column(column, justify="right")
    console = Console()
    for size in args.batches:
        batch = prompts(size)
        hf_runs, our_runs = [], []
        for _ in range(args.repeats):  # alternate, so that load from elsewhere hits both alike
            if not args.skip_hf:
                hf_runs.append(hf_generate(loaded, batch, args.max_tokens))
            our_runs.append(embedded_generate(backend, batch, args.max_tokens))
        ours = statistics.median(r.tokens / r.wall_s for r in our_runs)
        ours_cpu = statistics.median(r.tokens / r.cpu_s for r in our_runs)
        if hf_runs:
            hf = statistics.median(r.tokens / r.wall_s for r in hf_runs)
            hf_cpu = statistics.median(r.tokens / r.cpu_s for r in hf_runs)
            table.add_row("hf-generate", str(size), f"{hf:.1f}", "1.00x", f"{hf_cpu:.1f}")
        ratio = f"{ours / hf:.2f}x" if hf_runs else "-"
        table.add_row("embedded", str(size), f"{ours:.1f}", ratio, f"{ours_cpu:.1f}")
        console.print(f"batch {size} done", style="dim")
    backend.shutdown()
    console.print(table)


if __name__ == "__main__":
    main()
