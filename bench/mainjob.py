"""The main job's memory and update speed, without the whole run: `examples/quickstart.yaml`'s
learner and engine in one process, a validation-sized decode batch, then training steps on
batches of the quickstart's shape.

Batches: 8 tasks x 2 agents x K=4 branches; the tool agent's prompts are 270 tokens, the
plan agent's 300, of which the first 175 and 178 are the same for every task (the chat
template, system prompt and instructions, as in the run's traces: the learner feeds them
once per update, see trainer/learner/prefix.py), completions 6 to 24 tokens, 14 of the 16 groups per
agent kept (what drop_zero_std_groups leaves in the runs of docs/learning.md). Other token
ids are random: time and memory do not depend on them.

Per step it prints the update's wall and CPU time, its model FLOPs (`learner/gflops`, the
count `logging.mfu` uses in the real run) and its MFU against a 2048^3 fp32 matmul timed
right after the step on the same thread, so load on a shared machine moves both. At the end,
peak RSS (VmHWM) and where the resident memory is (glibc's in-use and free bytes, mapped
files), after load, after the decode batch and after the steps.

    python bench/mainjob.py                                  # 3 steps, engine on
    python bench/mainjob.py --set optim.max_tokens_per_microbatch=2048 --no-engine
    python bench/mainjob.py --steps 2 --profile 25           # where the last update's time goes
                                                             # (operators, then matmuls by shape)
    MASENVS_MALLOC=lean python bench/mainjob.py              # glibc tuned (no jemalloc)
    MASENVS_MALLOC=default python bench/mainjob.py           # glibc's own allocator settings
    python bench/mainjob.py --steps 8 --lora fused,peft      # LoRA's forward, alternating steps
By default it runs with jemalloc where libjemalloc is installed, as `masenvs train` does.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import random
import re
import statistics
import sys
from pathlib import Path
from typing import Any

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # bench/kernels.py would shadow the `kernels` package transformers imports

from masenvs.memory import (  # noqa: E402
    allocator,
    release_free_memory,
    restart_with_jemalloc,
    tune_allocator,
)

if __name__ == "__main__":
    restart_with_jemalloc(anywhere=True)  # the allocator `masenvs train` would run with

import torch  # noqa: E402

from masenvs.trainer import fast_lora  # noqa: E402
from masenvs.trainer.atgrpo import group_advantages  # noqa: E402
from masenvs.trainer.config import load_config  # noqa: E402
from masenvs.trainer.learner.flops import mfu_metrics  # noqa: E402
from masenvs.trainer.learner.learner import Learner  # noqa: E402
from masenvs.trainer.samples import Sample, tree_group  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "examples" / "quickstart.yaml"
PROMPTS = {"tool": 270, "plan": 300}
SHARED = {
    "tool": 175,
    "plan": 178,
}  # tokens every prompt of the agent starts with (the run's traces)
VOCAB = 49152


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def memory() -> dict[str, float]:
    """Resident and peak set, and glibc's view of the heap, in MiB."""
    text = Path("/proc/self/status").read_text()
    out = {
        k: int(re.search(rf"^{k}:\s+(\d+)", text, re.M)[1]) / 1024
        for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    }
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
        out["malloc_in_use"] = (info.uordblks + info.hblkhd) / 2**20
        out["malloc_free"] = info.fordblks / 2**20
    except (OSError, AttributeError):
        pass  # not glibc
    return {k: round(v) for k, v in out.items()}


def quickstart_batch(step: int, cfg: Any) -> list[Sample]:
    rng = random.Random(step)
    samples = []
    for agent, prompt_len in PROMPTS.items():
        head = [rng.randrange(VOCAB) for _ in range(SHARED[agent])]  # system prompt, instructions
        for task in range(8):
            rest = prompt_len - len(head) + rng.randint(-10, 10)
            prompt = head + [rng.randrange(VOCAB) for _ in range(rest)]
            flat = task >= 7  # one of 8 groups has equal rewards and is dropped
            for b in range(4):
                completion = [rng.randrange(VOCAB) for _ in range(rng.randint(6, 24))]
                reward = 0.0 if flat else float((b + task) % 3)
                group = tree_group(task, 0, agent)
                samples.append(Sample(prompt, completion, [], agent, agent, group, reward))
    return group_advantages(samples, cfg.algorithm)[0]


def decode_batch(cfg: Any, learner: Learner) -> Any:
    """The engine the run would start, after one validation-sized batch (32 greedy calls)."""
    from masenvs.engine.protocol import GenerateRequest, SamplingParams
    from masenvs.trainer.inference.engines import open_inference
    from masenvs.trainer.inference.plan import inference_plan

    plan = inference_plan(cfg, learner.agents, device=str(learner.device))
    backend = open_inference(plan, Path(cfg.run_dir))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=cfg.rollout.max_tokens, temperature=0.0, ignore_eos=True)

    async def run() -> None:
        requests = [
            GenerateRequest("", params, prompt=[rng.randrange(VOCAB) for _ in range(280)])
            for _ in range(cfg.rollout.concurrency)
        ]
        await asyncio.gather(*(backend.generate(r) for r in requests))

    asyncio.run(run())
    return backend


def print_matmuls(prof: Any, rows: int) -> None:
    """`aten::mm` by operand shapes: calls, time and GFLOP/s, costliest first; then the
    products with a dimension of 16 or less (LoRA's rank-r products) together."""
    shapes: dict[tuple, list[float]] = {}
    for event in prof.events():
        if event.name == "aten::mm" and len(event.input_shapes) >= 2:
            (m, k), (_, n) = event.input_shapes[:2]
            entry = shapes.setdefault((m, k, n), [0, 0.0])
            entry[0] += 1
            entry[1] += event.cpu_time_total / 1e6
    total = sum(t for _, t in shapes.values())
    flops = sum(2 * m * k * n * c for (m, k, n), (c, _) in shapes.items())
    print(f"aten::mm: {total:.2f} s, {flops / 1e9:.0f} GFLOP, {flops / 1e9 / total:.1f} GFLOP/s")
    ranked = sorted(shapes.items(), key=lambda item: -item[1][1])
    for (m, k, n), (count, seconds) in ranked[:rows]:
        rate = 2 * m * k * n * count / 1e9 / seconds
        print(f"  [{m}, {k}] @ [{k}, {n}]  {count:6d} calls  {seconds:6.2f} s  {rate:6.1f} GFLOP/s")
    small = [
        (c, t, 2 * m * k * n * c) for (m, k, n), (c, t) in shapes.items() if min(m, k, n) <= 16
    ]
    print(
        f"  with a dimension <= 16: {sum(c for c, _, _ in small)} calls, "
        f"{sum(t for _, t, _ in small):.2f} s, {sum(f for _, _, f in small) / 1e9:.1f} GFLOP"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], help="config override")
    parser.add_argument("--no-engine", action="store_true", help="the learner alone")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="profile the last step with torch.profiler and print its N costliest ops",
    )
    parser.add_argument(
        "--lora",
        default="",
        help="fused,peft: alternate the LoRA layers' forward step by step (trainer/learner/fast_lora.py); "
        "the paired ratio cancels a shared machine's drift",
    )
    args = parser.parse_args()
    kinds = list(dict.fromkeys(k for k in args.lora.split(",") if k))  # in order, once each
    if set(kinds) - {"fused", "peft"}:
        parser.error("--lora takes fused and/or peft")
    tune_allocator()  # as `masenvs train` does
    print(f"allocator: {allocator()}")
    cfg = load_config(CONFIG, [f"steps={args.steps}", *args.set])
    phases = {"start": memory()}
    learner = Learner(cfg, ["tool", "plan"])
    phases["learner loaded"] = memory()
    backend = None
    if not args.no_engine:
        backend = decode_batch(cfg, learner)
        phases["engine after a decode batch"] = memory()
    rows = []
    for step in range(args.steps):
        batch = quickstart_batch(step, cfg)
        kind = kinds[step % len(kinds)] if kinds else ""
        if kind:  # per_agent policies share one model: set each model once
            switch = fast_lora.install if kind == "fused" else fast_lora.uninstall
            for model in {id(p.model): p.model for p in learner.policies.values()}.values():
                switch(model)
        if args.profile and step == args.steps - 1:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                metrics = learner.step(batch)
            table = prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=args.profile, max_name_column_width=60
            )
            print(table, flush=True)
            print_matmuls(prof, args.profile)
        else:
            metrics = learner.step(batch)
        metrics.update(mfu_metrics(metrics))
        rows.append(
            {
                "wall_s": metrics["learner/time_s"],
                "cpu_s": metrics["learner/cpu_s"],
                "gflops": metrics["learner/gflops"],
                "matmul_gflop_per_s": metrics["learner/matmul_gflop_per_s"],
                "mfu": metrics["learner/mfu"],
                "mfu_cpu": metrics["learner/mfu_cpu"],
                "lora": kind,
            }
        )
        r = rows[-1]
        print(
            f"step {step}{f' ({kind})' if kind else ''}: {r['wall_s']:6.1f} s wall, {r['cpu_s']:6.1f} s CPU, "
            f"{r['gflops']:7.1f} GFLOP, MFU {r['mfu']:6.1%} (wall) {r['mfu_cpu']:6.1%} (CPU "
            f"time), matmul {r['matmul_gflop_per_s']:5.1f} GFLOP/s right after",
            flush=True,
        )
        release_free_memory()  # as `masenvs train` does between phases
        phases[f"after step {step}"] = memory()
    phases["after the steps"] = memory()
    if backend is not None:
        backend.shutdown()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, mem in phases.items():
        print(f"{name:30} " + "  ".join(f"{k} {v} MiB" for k, v in mem.items()))
    summary = {
        "median_wall_s": statistics.median(r["wall_s"] for r in rows),
        "median_cpu_s": statistics.median(r["cpu_s"] for r in rows),
        "median_mfu": statistics.median(r["mfu"] for r in rows),
        "median_mfu_cpu": statistics.median(r["mfu_cpu"] for r in rows),
        "peak_rss_mib": phases["after the steps"]["VmHWM"],
    }
    for kind in kinds:
        summary[f"{kind}_median_wall_s"] = statistics.median(
            r["wall_s"] for r in rows if r["lora"] == kind
        )
    if len(set(kinds)) == 2:  # each step against the step before it, the other kind's
        pairs = [(b, a) if b["lora"] == kinds[0] else (a, b) for a, b in zip(rows, rows[1:])]
        for key in ("wall_s", "cpu_s"):
            ratio = statistics.median(p[key] / q[key] for p, q in pairs)
            summary[f"{kinds[0]}_over_{kinds[1]}_{key}"] = round(ratio, 3)
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps({"steps": rows, "phases": phases, **summary}, indent=1))


if __name__ == "__main__":
    main()
