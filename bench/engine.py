"""Embedded engine vs Hugging Face `generate`: aggregate tokens/s at several batch sizes.

Both sides run in this one process on the same model, prompts and thread count, sample
at temperature 1 and generate exactly `--max-tokens` tokens per sequence (EOS ignored),
prefill included. Run:

    python bench/engine.py --model smollm2-135m --threads 2 --batches 1 8 32

Modes: HF `generate` in float32 (its default on CPU: the baseline) and bfloat16; the
embedded engine in float32, dense bfloat16, its default (bfloat16 on CPUs with native bf16;
4- and 8-bit weights read as the GGUF file stores them: `--quantize auto`), the default
serving a rank-8 LoRA adapter on every projection (what training rollouts run), the default
with the native CPU kernels off (`MASENVS_CPU_KERNELS=0`: what CPUs without AVX2 or gcc
get), bfloat16 with int8 weights (`--quantize int8`), and the default with
`batch_invariant=True` (`invariant`; its own bench: bench/batch_invariant.py).

`--isa avx2` emulates an AVX2+FMA CPU (no AVX-512) on a newer one: the engine runs its
AVX2 kernel set (`MASENVS_CPU_KERNELS=avx2`) and torch, for HF `generate` too, is held to
AVX2 (`ATEN_CPU_CAPABILITY=avx2`, `ONEDNN_MAX_CPU_ISA=AVX2`). The table's title says which
kernel set and torch CPU capability each mode ran with, and on which CPU.

    python bench/engine.py --isa avx2 --modes hf-fp32 auto --batches 1 8
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from masenvs.cache import DEFAULT_MODEL
from masenvs.engine import kernels as cpu_kernels
from masenvs.engine.engine import EmbeddedBackend
from masenvs.engine.loading import load_model
from masenvs.engine.protocol import GenerateRequest, SamplingParams

# Environment that makes this CPU behave as one with AVX2 and FMA but no AVX-512, for
# torch as for the engine; it must be set before torch is imported (the workers are
# spawned, so they import it afresh).
ISA_ENVIRONMENT = {
    "native": {},
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MASENVS_CPU_KERNELS": "avx2",
    },
}


def cpu_model() -> str:
    """The CPU's model name, as `lscpu` shows it."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown CPU"
    names = [line.partition(":")[2].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else "unknown CPU"


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


def logprob_gaps(
    backend: EmbeddedBackend, reference, batch: list[list[dict[str, str]]], max_tokens: int
) -> torch.Tensor:
    """|reported - float32 reference| log-probability of every sampled token."""
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0, ignore_eos=True)

    async def serve():
        return await asyncio.gather(
            *(backend.generate(GenerateRequest(model="", params=params, messages=m)) for m in batch)
        )

    gaps = []
    for generation in asyncio.run(serve()):
        prompt, completion = generation.prompt_token_ids, generation.completions[0]
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.inference_mode():
            logits = reference.model(ids).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0]
        gaps.append((torch.tensor(completion.logprobs) - expected).abs())
    return torch.cat(gaps)


def embedded_generate(
    backend: EmbeddedBackend, batch: list[list[dict[str, str]]], max_tokens: int, model: str = ""
) -> Rate:
    """Tokens/s of the engine serving the batch as concurrent requests to `model`."""
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)

    async def serve() -> Rate:
        start, cpu = time.perf_counter(), time.process_time()
        generations = await asyncio.gather(
            *(
                backend.generate(GenerateRequest(model=model, params=params, messages=m))
                for m in batch
            )
        )
        elapsed, cpu_used = time.perf_counter() - start, time.process_time() - cpu
        produced = sum(len(g.completions[0].token_ids) for g in generations)
        assert produced == len(batch) * max_tokens
        return Rate(produced, elapsed, cpu_used)

    return asyncio.run(serve())


LORA = "lora"


def random_lora(model: torch.nn.Module, rank: int = 8) -> dict[str, torch.Tensor]:
    """A peft-style LoRA state dict on every attention and MLP projection, B non-zero."""
    generator = torch.Generator().manual_seed(0)
    state = {}
    for name, module in model.named_modules():
        if name.endswith("_proj"):
            out_features, in_features = module.weight.shape
            state[f"{name}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator)
            state[f"{name}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator)
            state[f"{name}.lora_B.weight"] *= 1e-3
    return state


@dataclass
class Mode:
    label: str
    dtype: torch.dtype
    quantize: str = "none"  # engine modes only
    hf: bool = False
    lora: bool = False  # requests go to a random rank-8 adapter on every projection
    native: bool = True  # False: MASENVS_CPU_KERNELS=0, the torch code paths only
    batch_invariant: bool = False


MODES = {
    "hf-fp32": Mode("HF fp32", torch.float32, hf=True),
    "hf-bf16": Mode("HF bf16", torch.bfloat16, hf=True),
    "fp32": Mode("engine fp32", torch.float32),
    "bf16": Mode("engine bf16", torch.bfloat16),
    "auto": Mode("engine default", torch.bfloat16, quantize="auto"),
    "lora": Mode("default + LoRA r8", torch.bfloat16, quantize="auto", lora=True),
    "torch": Mode("default, torch kernels", torch.bfloat16, quantize="auto", native=False),
    "int8": Mode("engine int8", torch.bfloat16, quantize="int8"),
    "invariant": Mode("batch-invariant", torch.bfloat16, quantize="auto", batch_invariant=True),
}


class Worker:
    """One mode in its own process, so that no two modes share OpenMP thread pools (see
    masenvs/engine/omp.py) or allocator state; the parent only sends work and reads."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        context = multiprocessing.get_context("spawn")
        self.pipe, child = context.Pipe()
        self.process = context.Process(target=_serve_mode, args=(name, vars(args), child))
        self.process.start()
        # loaded and warmed up: the kernel set and torch CPU capability it runs with
        self.kernels, self.capability = self._reply()

    def run(self, size: int, max_tokens: int) -> Rate:
        self.pipe.send(("rate", size, max_tokens))
        return self._reply()

    def gaps(self, max_tokens: int) -> torch.Tensor:
        self.pipe.send(("gaps", 8, max_tokens))
        return self._reply()

    def close(self) -> None:
        self.pipe.send(None)
        self.process.join()

    def _reply(self):
        reply = self.pipe.recv()
        if isinstance(reply, BaseException):
            raise reply
        return reply


def _serve_mode(name: str, options: dict, pipe) -> None:
    try:
        args = argparse.Namespace(**options)
        torch.set_num_threads(args.threads)
        mode = MODES[name]
        if not mode.native:  # this worker process only
            os.environ["MASENVS_CPU_KERNELS"] = "0"
        engine = loaded = None
        model = LORA if mode.lora else ""  # the engine's request model name
        if mode.hf:
            loaded = load_model(args.model, device=args.device, dtype=mode.dtype)
            hf_generate(loaded, prompts(1), 2)
        else:  # as `masenvs serve` and `masenvs rollout` start it
            engine = EmbeddedBackend.from_spec(
                args.model,
                device=args.device,
                dtype=mode.dtype,
                max_batch_size=max(args.batches),
                quantize=mode.quantize,
                batch_invariant=mode.batch_invariant,
            )
            if mode.lora:
                engine.add_adapter("lora", random_lora(engine.model), rank=8, alpha=16)
            embedded_generate(engine, prompts(2), 4, model)  # warm-up
        native = engine is not None and engine.forward.native
        kernels = cpu_kernels.kernel_set() if native else None
        pipe.send((kernels or "torch", torch.backends.cpu.get_cpu_capability()))
        reference = None
        while (job := pipe.recv()) is not None:
            kind, size, max_tokens = job
            if kind == "rate" and engine is None:
                pipe.send(hf_generate(loaded, prompts(size), max_tokens))
            elif kind == "rate":
                pipe.send(embedded_generate(engine, prompts(size), max_tokens, model))
            else:
                if reference is None:
                    reference = load_model(args.model, device=args.device, dtype=torch.float32)
                pipe.send(logprob_gaps(engine, reference, prompts(size), max_tokens))
        if engine is not None:
            engine.shutdown()
    except BaseException as exc:  # shown by the parent
        pipe.send(RuntimeError(f"{name}: {exc!r}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=list(MODES),
        help="hf-fp32 is the baseline every ratio is taken against (HF's default on CPU)",
    )
    parser.add_argument(
        "--isa",
        choices=list(ISA_ENVIRONMENT),
        default="native",
        help="avx2: run as on a CPU with AVX2 and FMA but no AVX-512 (torch and the engine)",
    )
    args = parser.parse_args()
    os.environ.update(ISA_ENVIRONMENT[args.isa])  # inherited by the spawned workers

    console = Console()
    load_model(args.model)  # convert and cache once, before the workers load it
    workers = {name: Worker(name, args) for name in args.modes}
    if args.isa == "avx2" and any(w.capability != "AVX2" for w in workers.values()):
        raise SystemExit("torch ignored ATEN_CPU_CAPABILITY=avx2: the emulation did not hold")
    runs_with = ", ".join(
        f"{MODES[n].label}: kernels {w.kernels}, torch {w.capability}" for n, w in workers.items()
    )
    title = (
        f"{args.model} on {args.device} ({cpu_model()}, {os.cpu_count()} CPUs, isa "
        f"{args.isa}): aggregate tokens/s, {args.threads} threads, {args.max_tokens} new "
        f"tokens per sequence, prefill included\n{runs_with}"
    )
    table = Table(title=title)
    for column in ("mode", "batch", "tokens/s (median)", "vs HF fp32", "tokens per CPU-s"):
        table.add_column(column, justify="right")
    for size in args.batches:
        runs: dict[str, list[Rate]] = {name: [] for name in args.modes}
        for _ in range(args.repeats):  # interleaved, so load from elsewhere hits all alike
            for name, worker in workers.items():
                runs[name].append(worker.run(size, args.max_tokens))
        medians = {n: statistics.median(r.tokens / r.wall_s for r in rs) for n, rs in runs.items()}
        base = medians.get("hf-fp32")
        for name in args.modes:
            cpu = statistics.median(r.tokens / r.cpu_s for r in runs[name])
            ratio = f"{medians[name] / base:.2f}x" if base else "-"
            row = (MODES[name].label, str(size), f"{medians[name]:.1f}", ratio, f"{cpu:.1f}")
            table.add_row(*row)
            console.print(" | ".join(row), style="dim")  # as it comes: a long run may be cut
        table.add_section()
    console.print(table)

    fidelity = Table(title="sampled tokens' log-probs vs a float32 forward pass (|difference|)")
    for column in ("mode", "mean", "p99", "max"):
        fidelity.add_column(column, justify="right")
    for name, worker in workers.items():
        if not (MODES[name].hf or MODES[name].lora):  # lora: no reference to compare with
            gaps = worker.gaps(args.max_tokens)
            values = (gaps.mean(), gaps.quantile(0.99), gaps.max())
            fidelity.add_row(MODES[name].label, *(f"{v:.4f}" for v in values))
        worker.close()
    console.print(fidelity)


if __name__ == "__main__":
    main()
