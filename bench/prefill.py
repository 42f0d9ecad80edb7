"""How the embedded engine's prefill attends: torch's flash attention vs the decode kernel.

A prefill runs every prompt token through the model at once. Its attention can run as
torch's `scaled_dot_product_attention` over each prompt ("sdpa") or through the native
decode-attention kernel, each token as a decode step would attend ("decode-kernel": what
`batch_invariant` needs). The engine picks one per kernel set (`LlamaForward.
prefill_attention`); this bench times both on the same engine, greedy, one new token, so
that the prefill is nearly all the work (median of `--repeats`, prefix cache emptied
before each):

- quickstart: the quickstart's 32 validation prompts (~290 tokens; one shared system
  prompt, so most rows continue a cached prefix);
- long: 4 unrelated prompts of ~1700 tokens;
- long, cached document: 4 questions about one ~1500-token document that an earlier
  request left in the prefix cache (each prefill runs only the question's few tokens, but
  they attend to all the cached keys; "tokens" counts whole prompts).

The last columns compare the two modes' answers (both bfloat16): how many chose another
first token, and the largest gap between their log-probabilities where they chose the same
one. "ratio" is decode-kernel's time over sdpa's. Run:

    python bench/prefill.py                  # this CPU's kernels, then emulated AVX2
    python bench/prefill.py --isa native
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import statistics
import time

from engine import ISA_ENVIRONMENT, cpu_model
from rich.console import Console
from rich.table import Table

from masenvs.cache import DEFAULT_MODEL

MODES = ("sdpa", "decode-kernel")
WORDS = (  # split in _text
    "river stone light market winter garden letter engine window forest paper village "
    "harbour signal copper thunder candle mirror ladder orchard lantern meadow bridge "
    "compass kettle ribbon saddle timber velvet whistle anchor basket cellar falcon "
    "granite hollow island jacket kernel lemon marble needle orange pepper quartz "
    "rocket silver tunnel umbrella violin wagon yellow zebra slowly quickly under over "
    "between after before because although while the a an of to and in on with from"
)


def _text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    vocabulary = WORDS.split()
    return " ".join(rng.choice(vocabulary) for _ in range(words))


def _scenarios(tasks: int) -> dict[str, tuple[list, list]]:
    """name -> (untimed requests sent first, timed requests), as chat messages."""
    import masenvs

    env = masenvs.make(
        "plan_path", size=4, obstacle_ratio=0.1, tool_task="propose", show_offset=True
    )
    quickstart = [env.reset(seed=1_000_000 + i)[1]["tool"]["messages"] for i in range(tasks)]
    long = [
        [{"role": "user", "content": f"{_text(i, 1300)}\nSum this up in one word."}]
        for i in range(4)
    ]
    document = _text(99, 1150)

    def about(question: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{document}\n{question}"}]

    questions = ["Which metal comes up?", "Name a tool.", "Is there water?", "Pick a colour."]
    return {
        "quickstart": ([], quickstart),
        "long": ([], long),
        "long, cached document": ([about("Say nothing.")], [about(q) for q in questions]),
    }


def _measure(model: str, tasks: int, repeats: int, pipe) -> None:
    try:
        from masenvs.engine import kernels as cpu_kernels
        from masenvs.engine.engine import EmbeddedBackend
        from masenvs.engine.protocol import GenerateRequest, SamplingParams

        engine = EmbeddedBackend.from_spec(model)
        default = engine.forward.prefill_attention
        params = SamplingParams(max_tokens=1, temperature=0.0)

        async def answer(messages) -> tuple[int, float]:
            request = GenerateRequest(model="", params=params, messages=messages)
            choice = (await engine.generate(request)).completions[0]
            return choice.token_ids[0], choice.logprobs[0]

        async def run(first: list, timed: list) -> tuple[list[float], list, int]:
            seconds = []
            for _ in range(repeats + 1):  # the first is a warm-up
                engine.reset_prefix_cache()
                for messages in first:
                    await answer(messages)
                tokens = engine.stats.prompt_tokens
                start = time.perf_counter()
                answers = await asyncio.gather(*(answer(m) for m in timed))
                seconds.append(time.perf_counter() - start)
                tokens = engine.stats.prompt_tokens - tokens
            return seconds[1:], answers, tokens

        results = {}
        for name, (first, timed) in _scenarios(tasks).items():
            for mode in MODES:
                engine.forward.prefill_attention = mode
                results[name, mode] = asyncio.run(run(first, timed))
        engine.shutdown()
        pipe.send((cpu_kernels.kernel_set() or "torch", default, results))
    except BaseException as exc:  # shown by the parent
        pipe.send(RuntimeError(f"{exc!r}"))


def _run(isa: str, args) -> tuple:
    saved = dict(os.environ)
    os.environ.update(ISA_ENVIRONMENT[isa])  # read by the spawned process's torch
    try:
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(
            target=_measure, args=(args.model, args.tasks, args.repeats, child)
        )
        process.start()
        reply = parent.recv()
        process.join()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if isinstance(reply, BaseException):
        raise SystemExit(f"isa {isa}: {reply}")
    return reply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--isa", nargs="+", choices=list(ISA_ENVIRONMENT), default=["native", "avx2"]
    )
    args = parser.parse_args()

    table = Table(
        title=f"{args.model}: prefill attention, greedy, 1 new token "
        f"({cpu_model()}, {os.cpu_count()} CPUs)"
    )
    columns = ("kernels (isa)", "prompts", "tokens", *MODES, "ratio", "tokens differ")
    for column in (*columns, "max |logprob gap|"):
        table.add_column(column, justify="right")
    for isa in args.isa:
        kernels, default, results = _run(isa, args)
        for name in dict.fromkeys(scenario for scenario, _ in results):
            walls = {mode: statistics.median(results[name, mode][0]) for mode in MODES}
            pairs = list(zip(*(results[name, mode][1] for mode in MODES)))
            same = [abs(a[1] - b[1]) for a, b in pairs if a[0] == b[0]]
            cells = [f"{walls[m]:.2f} s" + (" (default)" if m == default else "") for m in MODES]
            table.add_row(
                f"{kernels} ({isa})",
                name,
                str(results[name, MODES[0]][2]),
                *cells,
                f"{walls[MODES[1]] / walls[MODES[0]]:.2f}x",
                f"{len(pairs) - len(same)} / {len(pairs)}",
                f"{max(same):.3f}" if same else "-",
            )
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
