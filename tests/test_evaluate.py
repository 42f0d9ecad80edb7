"""`masenvs eval`: the pass@k estimator, and a trained checkpoint against its base model
(embedded engine and an OpenAI-compatible URL) on a small math dataset."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from masenvs.adapters.endpoint import EndpointServer, create_app
from masenvs.engine.engine import EmbeddedBackend
from masenvs.engine.loading import load_model
from masenvs.registry import make
from masenvs.tasks.loaders import write_jsonl
from masenvs.tasks.records import MathTask
from masenvs.traces import TraceStore
from masenvs.trainer.commands.eval import build_parser, main
from masenvs.trainer.config import load_config
from masenvs.trainer.evaluate import pass_at_k
from masenvs.trainer.learner.learner import Learner
from masenvs.trainer.run.checkpoint import TrainState, save_checkpoint


@pytest.mark.parametrize("n", [1, 3, 5, 6])
def test_pass_at_k_is_the_chance_that_k_of_n_samples_hold_a_success(n: int) -> None:
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            draws = list(itertools.combinations(outcomes, k))
            exact = sum(any(d) for d in draws) / len(draws)
            assert pass_at_k(n, c, k) == pytest.approx(exact)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


TASKS = [
    MathTask("seven", "What is 3 + 4?", "7"),
    MathTask("twelve", "What is 5 + 7?", "12"),
]
ANSWER = "\\boxed{7}"


def checkpoint_that_answers_seven(tmp_path: Path) -> tuple[Path, Path]:
    """A real training checkpoint whose reasoner adapter answers \\boxed{7} to every task."""
    data = write_jsonl(TASKS, tmp_path / "tasks.jsonl")
    options = {"single_agent": True, "max_rounds": 1, "source": f"jsonl:{data}"}
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            "model.name=tiny",
            "env.name=math",
            f"env.options={json.dumps(options)}",
            "lora.rank=8",
            "lora.alpha=16",
        ],
    )
    learner = Learner(cfg, ["reasoner"])
    tokenizer = load_model("tiny").tokenizer
    env = make("math", **options)
    completion = tokenizer.encode(ANSWER, add_special_tokens=False) + [tokenizer.eos_token_id]
    rows = []
    for task in TASKS:
        _, infos = env.reset(seed=0, options={"task": task})
        prompt = tokenizer.apply_chat_template(
            infos["reasoner"]["messages"],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        rows.append((list(prompt), completion))
    policy = learner.policies["reasoner"]
    optimizer = torch.optim.Adam(policy.params, lr=1e-2)
    policy.model.train()
    # Supervised: the adapter learns to answer 7, whatever the question. The tiny model's
    # logits are nearly flat (its random LM head caps them), so only greedy decoding says 7.
    for _ in range(15):
        optimizer.zero_grad()
        for prompt, target in rows:
            ids = torch.tensor([prompt + target[:-1]])
            logits = policy.model(input_ids=ids).logits[0, len(prompt) - 1 :]
            F.cross_entropy(logits.float(), torch.tensor(target)).backward()
        optimizer.step()
    policy.model.eval()
    path = save_checkpoint(cfg.run_dir, learner, TrainState(step=3, next_task_seed=0), cfg)
    return path, data


def test_a_checkpoint_is_scored_beside_its_base_model(tmp_path: Path) -> None:
    checkpoint, data = checkpoint_that_answers_seven(tmp_path)
    # The same adapter behind an OpenAI-compatible server (what `masenvs serve` runs).
    # float32 everywhere: greedy picks among nearly equal logits (see above).
    engine = EmbeddedBackend.from_spec("tiny", max_model_len=512, dtype="float32")
    asyncio.run(engine.load_adapter("trained", str(checkpoint / "adapters" / "reasoner")))
    out = tmp_path / "eval.json"
    try:
        with EndpointServer(create_app(engine, policy_map={"reasoner": "trained"})) as server:
            code = main(
                [
                    "--checkpoint",
                    str(checkpoint),
                    "--baseline",
                    "--url",
                    server.base_url,
                    "--source",
                    f"jsonl:{data}",
                    "-k",
                    "2",
                    "-n",
                    "3",
                    "--temperature",
                    "0",
                    "--dtype",
                    "float32",
                    "--max-tokens",
                    "8",
                    "--out",
                    str(out),
                ]
            )
    finally:
        engine.shutdown()
    assert code == 0
    report = json.loads(out.read_text())
    assert report["env"] == "math" and report["tasks"] == ["seven", "twelve"]
    assert (report["n"], report["k"]) == (3, 2)
    base, trained, served = report["results"]
    assert [r["name"] for r in report["results"]] == ["base", "run@3", server.base_url]
    # The base model never answers \boxed{7}; the trained adapter always does, which is
    # right for one task of two, through the embedded engine and through the URL alike.
    assert base["per_task"] == [{"id": "seven", "successes": 0}, {"id": "twelve", "successes": 0}]
    assert (base["avg"], base["pass_at_k"]) == (0.0, 0.0)
    for result in (trained, served):
        assert result["per_task"] == [
            {"id": "seven", "successes": 3},
            {"id": "twelve", "successes": 0},
        ]
        assert (result["avg"], result["pass_at_k"]) == (0.5, 0.5)
        assert result["errors"] == 0
    # Embedded policies are captured: each has its own traces beside the JSON.
    assert (tmp_path / "eval" / "run_3").is_dir() and (tmp_path / "eval" / "base").is_dir()


def lora_checkpoint(tmp_path: Path, *overrides: str) -> tuple[Path, Path]:
    """An untrained math checkpoint of the tool and reasoner agents, as the learner saves it
    (one LoRA adapter per agent unless `overrides` say otherwise), and its task file."""
    data = write_jsonl(TASKS, tmp_path / "tasks.jsonl")
    options = {"max_rounds": 1, "source": f"jsonl:{data}"}
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            "model.name=tiny",
            "env.name=math",
            f"env.options={json.dumps(options)}",
            "lora.rank=8",
            "lora.alpha=16",
            *overrides,
        ],
    )
    learner = Learner(cfg, ["tool", "reasoner"])
    return save_checkpoint(cfg.run_dir, learner, TrainState(step=2, next_task_seed=0), cfg), data


def test_role_swap_plays_each_role_with_the_others_trained_policy(tmp_path: Path) -> None:
    """`--swap tool=reasoner`: Stronger-MAS's swapped-policies test. Every call of the
    reasoner role goes to the tool's adapter and the other way round; the unswapped run
    beside it keeps them in place."""
    checkpoint, data = lora_checkpoint(tmp_path)
    base_args = ["--checkpoint", str(checkpoint), "--source", f"jsonl:{data}"]
    base_args += ["--temperature", "0", "--dtype", "float32", "--max-tokens", "4"]

    def served(out: Path, *extra: str) -> set[tuple[str, str]]:
        assert main([*base_args, *extra, "--out", str(out)]) == 0
        traces = next(p for p in out.with_suffix("").iterdir() if p.is_dir())
        return {(c.agent, c.model) for c in TraceStore(traces).calls()}

    swapped_out = tmp_path / "swapped.json"
    assert served(swapped_out, "--swap", "tool=reasoner") == {
        ("tool", "ckpt0.reasoner"),
        ("reasoner", "ckpt0.tool"),
    }
    report = json.loads(swapped_out.read_text())
    assert report["swap"] == {"tool": "reasoner", "reasoner": "tool"}
    assert [r["name"] for r in report["results"]] == ["run@2 swap reasoner=tool"]
    assert served(tmp_path / "plain.json") == {
        ("tool", "ckpt0.tool"),
        ("reasoner", "ckpt0.reasoner"),
    }
    for bad, why in [("tool=tool", "two different agents"), ("tool=coder", "not an agent")]:
        assert main([*base_args, "--swap", bad, "--out", str(tmp_path / "x.json")]) == 2, why


def test_swap_scores_the_papers_100_held_out_tasks_greedily_unless_told_otherwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stronger-MAS's swap protocol is --swap's default: 100 fixed held-out tasks (the
    checkpoint's validation seeds), greedy; --tasks and --temperature still say otherwise."""
    checkpoint, _ = lora_checkpoint(tmp_path)  # tasks by seed: the checkpoint's held-out ones
    args = ["--checkpoint", str(checkpoint), "--dtype", "float32", "--max-tokens", "1"]
    args += ["--concurrency", "32"]
    swapped = tmp_path / "swap.json"
    assert main([*args, "--swap", "tool=reasoner", "--out", str(swapped)]) == 0
    header = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal's width
    report = json.loads(swapped.read_text())
    assert len(report["tasks"]) == 100 and report["tasks"][0] == "math:1000000"
    assert report["sampling"]["temperature"] == 0.0 and (report["n"], report["k"]) == (1, 1)
    assert "100 tasks of math, 1 episode(s) each, T=0 (greedy)" in header
    assert "protocol is 100 held-out tasks, greedy; this is it" in header
    told = tmp_path / "told.json"
    extra = ["--tasks", "3", "--temperature", "0.5", "--out", str(told)]
    assert main([*args, "--swap", "tool=reasoner", *extra]) == 0
    report = json.loads(told.read_text())
    assert len(report["tasks"]) == 3 and report["sampling"]["temperature"] == 0.5
    assert "this run differs (3 tasks, T=0.5)" in " ".join(capsys.readouterr().out.split())
    help_text = build_parser().format_help()
    assert "100" in help_text and "greedy" in help_text


def test_a_swap_that_changes_no_weights_is_an_error_that_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run whose roles share one policy (the shared 1.7B paper config) plays the same
    weights in every seat: a swap there would silently score the unswapped run."""
    checkpoint, data = lora_checkpoint(tmp_path, "policy.mode=shared")
    args = ["--checkpoint", str(checkpoint), "--source", f"jsonl:{data}"]
    args += ["--out", str(tmp_path / "x.json")]
    assert main([*args, "--swap", "tool=reasoner"]) == 2
    said = " ".join(capsys.readouterr().out.split())
    assert "same weights" in said and "changes nothing" in said
    assert "policy.mode" in said and "per_agent" in said  # what to do instead
    assert not (tmp_path / "x.json").exists()
    # An unknown role names the agents and the likely one.
    assert main([*args, "--swap", "tool=reasonr"]) == 2
    said = " ".join(capsys.readouterr().out.split())
    assert "not an agent" in said and "did you mean 'reasoner'" in said
    # A server asked for one model name by every agent: the same weights too.
    url = ["--source", f"jsonl:{data}", "--env", "math", "--out", str(tmp_path / "y.json")]
    url += ["--url", "http://127.0.0.1:9/v1", "--served-model", "Qwen/Qwen3-1.7B"]
    assert main([*url, "--swap", "tool=reasoner"]) == 2
    said = " ".join(capsys.readouterr().out.split())
    assert "same weights" in said and "--served-model tool=" in said


FULL_ANSWERS = {"tool": "\\boxed{7}", "reasoner": "\\boxed{12}"}


def full_checkpoint_per_role(tmp_path: Path) -> tuple[Path, Path]:
    """A real checkpoint of full fine-tuning, one whole model per role (models/<role>/):
    the tool's model answers \\boxed{7} to any prompt, the reasoner's \\boxed{12}."""
    data = write_jsonl(TASKS, tmp_path / "tasks.jsonl")
    options = {"max_rounds": 1, "source": f"jsonl:{data}"}
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            "model.name=tiny",
            "env.name=math",
            f"env.options={json.dumps(options)}",
            "policy.finetune=full",
            "policy.mode=per_agent",
        ],
    )
    learner = Learner(cfg, ["tool", "reasoner"])
    tokenizer = load_model("tiny").tokenizer
    env = make("math", **options)
    prompts = []  # every prompt a seat can see: the tool's, the reasoner's after either answer
    for task in TASKS:
        _, infos = env.reset(seed=0, options={"task": task})
        prompts.append(infos["tool"]["messages"])
        for answer in FULL_ANSWERS.values():
            env.reset(seed=0, options={"task": task})
            _, _, _, _, infos = env.step({"tool": answer})
            prompts.append(infos["reasoner"]["messages"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains faster on one thread than on a busy two
    try:
        for role, answer in FULL_ANSWERS.items():
            teach(learner.policies[role].model, tokenizer, prompts, answer)
    finally:
        torch.set_num_threads(threads)
    path = save_checkpoint(cfg.run_dir, learner, TrainState(step=4, next_task_seed=0), cfg)
    return path, data


def teach(model: Any, tokenizer: Any, prompts: list[list[dict[str, str]]], answer: str) -> None:
    """Supervised steps until `model` answers `answer` to each of `prompts`."""
    completion = tokenizer.encode(answer, add_special_tokens=False)
    completion.append(tokenizer.eos_token_id)
    rows = [
        list(tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=False))
        for m in prompts
    ]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(25):
        optimizer.zero_grad()
        for prompt in rows:
            ids = torch.tensor([prompt + completion[:-1]])
            # Logits of the completion's positions only: the LM head is most of the cost.
            logits = model(input_ids=ids, logits_to_keep=len(completion)).logits[0]
            F.cross_entropy(logits.float(), torch.tensor(completion)).backward()
        optimizer.step()
    model.eval()


def test_full_model_checkpoints_per_role_are_evaluated_and_swapped(tmp_path: Path) -> None:
    """A run that fine-tuned one whole model per role (models/<role>/, no adapters) is a
    --checkpoint like any other; --swap sends each seat's calls to its partner's model."""
    checkpoint, data = full_checkpoint_per_role(tmp_path)
    assert not (checkpoint / "adapters").exists()
    args = ["--checkpoint", str(checkpoint.parent.parent), "--source", f"jsonl:{data}"]
    args += ["--temperature", "0", "--dtype", "float32", "--max-tokens", "8"]

    def answers(out: Path, *extra: str) -> dict[str, set[tuple[str, str]]]:
        """Per seat: (the model its calls went to, the role whose taught answer it gave)."""
        assert main([*args, *extra, "--out", str(out)]) == 0
        traces = next(p for p in out.with_suffix("").iterdir() if p.is_dir())
        seen: dict[str, set[tuple[str, str]]] = {}
        for call in TraceStore(traces).calls():
            text = call.choices[0].text  # the tiny model may add a brace: match the answer
            taught = next((r for r, a in FULL_ANSWERS.items() if a[1:] in text), text)
            seen.setdefault(call.agent, set()).add((call.model, taught))
        return seen

    own = answers(tmp_path / "own.json")
    assert own == {"tool": {("ckpt0.tool", "tool")}, "reasoner": {("ckpt0.reasoner", "reasoner")}}
    swapped = answers(tmp_path / "swapped.json", "--swap", "tool=reasoner")
    assert swapped == {
        "tool": {("ckpt0.reasoner", "reasoner")},
        "reasoner": {("ckpt0.tool", "tool")},
    }
    report = json.loads((tmp_path / "swapped.json").read_text())
    assert [r["name"] for r in report["results"]] == ["run@4 swap reasoner=tool"]


def test_device_auto_puts_the_engines_on_a_gpu_where_torch_sees_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--device auto` (the default): a GPU run of the swap protocol must not decode two 1.7B
    models on the CPU."""
    from masenvs.trainer.commands.eval import engine_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert (engine_device("auto"), engine_device("cpu")) == ("cuda", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert (engine_device("auto"), engine_device("cuda")) == ("cpu", "cuda")
