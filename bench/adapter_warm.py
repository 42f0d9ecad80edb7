"""A first call to a LoRA adapter against a base call, after `masenvs serve` starts.

`masenvs serve` warms the base model and every `--adapter` before its banner (one short
call each). Each round starts a fresh server (the first call is first only once), waits
for its banner, then times the first call to an adapter and a call to the base model,
in alternating order so drift hits both alike, through the official openai client.
The `cold` rows time the same two calls, the adapter's first, on an engine not warmed
(as serve started before issue 44), each round in a fresh process. Medians over the rounds, the
paired ratio first-adapter/base (median of each round's ratio), serve's own warm-up
times, and `lscpu`'s model name are printed.

    python bench/adapter_warm.py                        # smollm2-135m, 3 rounds
    python bench/adapter_warm.py --model tiny --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from masenvs.cache import DEFAULT_MODEL

PROMPT = [{"role": "user", "content": "Name three prime numbers and say why each is prime."}]
MAX_TOKENS = 16


def make_adapter(model: str, directory: Path) -> Path:
    """A rank-8 LoRA on every projection, as a training run writes one (small random B)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from masenvs.engine.loading import load_model

    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(0)
    peft_model = get_peft_model(
        load_model(model).model, LoraConfig(r=8, lora_alpha=16, target_modules=modules)
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    peft_model.save_pretrained(directory)
    return directory


def served_round(model: str, adapter: Path, adapter_first: bool) -> dict[str, float]:
    """Start `masenvs serve`, time a first adapter call and a base call; serve's warm-ups."""
    import openai

    command = [sys.executable, "-m", "masenvs", "serve", "--model", model, "--port", "0"]
    server = subprocess.Popen(
        [*command, "--adapter", f"lora={adapter}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    result: dict[str, float] = {}
    try:
        assert server.stdout is not None
        for line in server.stdout:
            warmed = re.search(r"warmed (base|adapter \w+) in ([\d.]+) s", line)
            if warmed:
                result["warm " + warmed[1].split()[0]] = float(warmed[2])
            if " at http://" in line:
                url = line.split(" at ")[-1].strip()
                break
        else:
            raise RuntimeError("masenvs serve exited before its banner")
        client = openai.OpenAI(base_url=url, api_key="unused")
        client.models.list()  # the connection is open before either timed call
        for name in ("lora", "base") if adapter_first else ("base", "lora"):
            start = time.perf_counter()
            client.chat.completions.create(
                model=name,
                messages=PROMPT,
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                extra_body={"ignore_eos": True},  # every call runs to MAX_TOKENS
            )
            result["first adapter" if name == "lora" else "base"] = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=60)
    return result


def cold_child(model: str, adapter: str, adapter_first: bool) -> None:
    """In this process: an engine that was never warmed; print the two calls' times."""
    from masenvs.engine.engine import EmbeddedBackend
    from masenvs.engine.protocol import GenerateRequest, SamplingParams

    engine = EmbeddedBackend.from_spec(model)
    asyncio.run(engine.load_adapter("lora", adapter))
    result = {}
    for name in ("lora", "base") if adapter_first else ("base", "lora"):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        asyncio.run(engine.generate(GenerateRequest(model=name, params=params, messages=PROMPT)))
        result["first adapter" if name == "lora" else "base"] = time.perf_counter() - start
    engine.shutdown()
    print(json.dumps(result))


def cold_round(model: str, adapter: Path, adapter_first: bool) -> dict[str, float]:
    flags = ["--adapter-first"] if adapter_first else []
    done = subprocess.run(
        [sys.executable, __file__, "--cold-child", str(adapter), "--model", model, *flags],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def cpu_name() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def report(title: str, rounds: list[dict[str, float]]) -> None:
    ratios = [r["first adapter"] / r["base"] for r in rounds]
    print(f"{title}:")
    for key in sorted({k for r in rounds for k in r}):
        values = [r[key] for r in rounds if key in r]
        shown = ", ".join(f"{v:.2f}" for v in values)
        print(f"  {key:<14} median {statistics.median(values):7.2f} s   ({shown})")
    print(f"  first adapter / base, paired median: {statistics.median(ratios):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-cold", action="store_true", help="skip the unwarmed rows")
    parser.add_argument("--cold-child", help=argparse.SUPPRESS)
    parser.add_argument("--adapter-first", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cold_child:
        cold_child(args.model, args.cold_child, args.adapter_first)
        return
    with tempfile.TemporaryDirectory() as tmp:
        adapter = make_adapter(args.model, Path(tmp) / "lora")
        served, cold = [], []
        for i in range(args.rounds):
            served.append(served_round(args.model, adapter, adapter_first=i % 2 == 0))
            if not args.no_cold:
                cold.append(cold_round(args.model, adapter, adapter_first=True))
    print(
        f"{args.model}, {args.rounds} rounds, {MAX_TOKENS} tokens per call; {cpu_name()}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    report("masenvs serve (warmed at start)", served)
    if cold:
        report("not warmed (an engine's first calls)", cold)


if __name__ == "__main__":
    main()
