"""masenvs envs inside TRL's real `GRPOTrainer` (`environment_factory`), on CPU, tiny model.

Every reward TRL logs is checked against a replay of the same completion through the masenvs
env itself (`make`, `reset(seed)`, `step`), written here without the integration: same
reward everywhere. The tiny model writes random text (no tool calls), so the multi-turn paths
run with a scripted policy in place of `model.generate`; TRL's tool loop, resets, reward calls
and logging stay TRL's own.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import masenvs  # noqa: E402
from masenvs.engine.loading import load_model  # noqa: E402
from masenvs.integrations.episode import openai_player  # noqa: E402
from masenvs.integrations.trl import environment, tool_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_path() -> str:
    return str(load_model("tiny").path)


def config(tmp_path: Path, **overrides: Any) -> GRPOConfig:
    settings: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "max_steps": 2,
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 24,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "use_cpu": True,
        "bf16": False,
        "report_to": "none",
        "save_strategy": "no",
        "seed": 0,
        "gradient_checkpointing": False,
    }
    return GRPOConfig(**{**settings, **overrides})


# --- the masenvs side: a replay written without the integration ------------------------------


def tool_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [c["function"] for c in message.get("tool_calls") or []]


def replay(
    env_name: str,
    options: dict[str, Any],
    seed: int,
    completion: list[dict[str, Any]],
    role: str | None = None,
    others: Callable[[str, list[dict[str, str]]], str] | None = None,
) -> tuple[float, list[str], str]:
    """Play a TRL completion's moves on a fresh masenvs env: every `answer(text=...)` call while
    the episode runs, then the final reply if it calls no tool and the episode still runs.
    Returns the policy's return, the observation after each move that was played (None once
    over) and the first observation."""
    env = masenvs.make(env_name, **options)
    env.reset(seed=seed)
    returns = dict.fromkeys(env.possible_agents, 0.0)

    def step(agent: str, action: str) -> None:
        _, rewards, _, _, _ = env.step({agent: action})
        for a, r in rewards.items():
            returns[a] += r

    def others_move() -> None:
        while env.agents and role is not None and env.acting != role:
            assert others is not None
            step(env.acting, others(env.acting, env.messages(env.acting)))

    others_move()
    first = env.observe(env.acting)
    seen: list[Any] = []
    for message in completion:
        if message["role"] != "assistant":
            continue
        for call in tool_calls(message):
            if call["name"] == "answer" and set(call["arguments"]) == {"text"} and env.agents:
                step(env.acting, str(call["arguments"]["text"]))
                others_move()
                seen.append(env.observe(env.acting) if env.agents else None)
    last = completion[-1]
    if last["role"] == "assistant" and not tool_calls(last) and env.agents:
        step(env.acting, last["content"])
    trained = [a for a in returns if role is None or a == role]
    return sum(returns[a] for a in trained), seen, first


def logged_rows(trainer: GRPOTrainer, name: str) -> list[dict[str, Any]]:
    logs = trainer._logs
    rows = []
    for i, completion in enumerate(logs["completion"]):
        rows.append(
            {
                "prompt": logs["prompt"][i],
                "completion": completion,
                "reward": logs["rewards"][name][i],
                **{k: v[i] for k, v in logs["extra"].items()},
            }
        )
    return rows


def check_replay(
    rows: list[dict[str, Any]],
    env_name: str,
    options: dict[str, Any],
    role: str | None = None,
    others: Callable[[str, list[dict[str, str]]], str] | None = None,
) -> None:
    for row in rows:
        expected, seen, first = replay(
            env_name, options, row["seed"], row["completion"], role, others
        )
        assert row["reward"] == pytest.approx(expected, abs=1e-5)
        # The policy saw the env's own observations: first in the prompt, then as tool results.
        assert row["prompt"][-1]["content"] == first
        results = [m["content"] for m in row["completion"] if m["role"] == "tool"]
        played = [r for r in results if not r.startswith("{'error'")]
        for result, observation in zip(played, seen, strict=False):
            if observation is None:
                assert result.startswith("The episode is over")
            else:
                assert result == observation


# --- one policy plays every role, real generation -------------------------------------------


def test_grpo_trains_two_steps_and_logs_the_env_rewards(tiny_path: str, tmp_path: Path) -> None:
    options = {"size": 4, "tool_task": "propose"}
    game = environment("plan_path", **options)
    trainer = GRPOTrainer(
        model=tiny_path,
        processing_class=tool_tokenizer(tiny_path),
        args=config(tmp_path),
        train_dataset=game.dataset(8),
        reward_funcs=game.reward,
        environment_factory=game.factory,
    )
    trainer.train()

    assert trainer.state.global_step == 2
    name = game.reward.__name__
    logged = [h for h in trainer.state.log_history if f"rewards/{name}/mean" in h]
    assert len(logged) == 2
    # The reward parts reach TRL's logs beside the reward.
    for level in ("process", "agent", "team", "success", "done"):
        assert f"{name}/{level}" in logged[0]

    rows = logged_rows(trainer, name)
    assert len(rows) == 4
    # Random text is no parsable answer: the env's own format penalty, as masenvs gives it.
    assert all(row["reward"] < 0 for row in rows)
    check_replay(rows, "plan_path", options)


# --- scripted moves through TRL's tool loop -------------------------------------------------

WORD = re.compile(r"Say (\w+)\.")


def call(arguments: dict[str, str]) -> str:
    body = json.dumps({"name": "answer", "arguments": arguments})
    return f"<tool_call>\n{body}\n</tool_call><|im_end|>"


def text(reply: str) -> str:
    return f"{reply}<|im_end|>"


# Each style is a list of replies, one per assistant turn; `w` is the word to say.
STYLES: dict[str, Callable[[str], list[str]]] = {
    "right": lambda w: [call({"text": w}), call({"text": w}), text("Done.")],
    "wrong": lambda w: [call({"text": "nope"}), text("nope")],
    "late": lambda w: [call({"text": w + "!"}), call({"text": w}), call({"text": w}), text("ok")],
    "plain": lambda w: [text(w)],
    "badargs": lambda w: [call({"move": w}), text(w)],
}
# The return of each style on say/echo (hit 1, miss 0) when one policy plays both roles.
RETURNS = {"right": 2.0, "wrong": 0.0, "late": 2.0, "plain": 1.0, "badargs": 1.0}


def style_of(first_reply: str, word: str) -> str:
    for style, replies in STYLES.items():
        if replies(word)[0].removesuffix("<|im_end|>") == first_reply.strip():
            return style
    raise AssertionError(f"unscripted reply {first_reply!r}")


def scripted_policy(conversation: str, index: int) -> str:
    """The next reply: the style is picked by batch index on the first turn, then read back
    from the conversation (TRL's tool loop passes only the rollouts still calling tools)."""
    word = WORD.findall(conversation)[-1]
    turns = conversation.split("<|im_start|>assistant\n")[1:-1]
    if not turns:
        style = list(STYLES)[index % len(STYLES)]
    else:
        style = style_of(turns[0].split("<|im_end|>")[0], word)
    replies = STYLES[style](word)
    return replies[len(turns)] if len(turns) < len(replies) else text("ok")


class ScriptedTrainer(GRPOTrainer):
    """TRL's GRPOTrainer with `scripted_policy` in place of sampling from the model."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, **kw):
        tokenizer = self.processing_class
        replies = [scripted_policy(tokenizer.decode(ids), i) for i, ids in enumerate(prompt_ids)]
        return [tokenizer(r, add_special_tokens=False)["input_ids"] for r in replies], None


def test_every_role_through_tool_calls(tiny_path: str, tmp_path: Path) -> None:
    game = environment("say")
    trainer = ScriptedTrainer(
        model=tiny_path,
        processing_class=tool_tokenizer(tiny_path),
        args=config(
            tmp_path, per_device_train_batch_size=5, num_generations=5, max_completion_length=256
        ),
        train_dataset=game.dataset(4),
        reward_funcs=game.reward,
        environment_factory=game.factory,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 2
    # The styles' returns differ, so GRPO's advantages do too: the weights move.
    assert any(not p.equal(before[n]) for n, p in trainer.model.named_parameters())

    rows = logged_rows(trainer, game.reward.__name__)
    assert len(rows) == 5
    for row in rows:
        word = WORD.findall(row["prompt"][-1]["content"])[-1]
        first = row["completion"][0]
        reply = call(tool_calls(first)[0]["arguments"]) if tool_calls(first) else first["content"]
        style = style_of(reply.removesuffix("<|im_end|>"), word)
        assert row["reward"] == RETURNS[style], style
        results = [m["content"] for m in row["completion"] if m["role"] == "tool"]
        if style == "right":  # the second role's prompt, then the end
            assert (
                results[0] == f"You answer with exactly one word and nothing else.\n\nSay {word}."
            )
            assert results[1].startswith("The episode is over: solved")
            assert row["success"] and row["done"]
        if style == "late":  # a move after the end: a clear message, nothing played
            assert "episode is over" in results[2] and "error" in results[2]
        if style == "badargs":  # TRL's own error; the env is untouched
            assert "error" in results[0]
    check_replay(rows, "say", {})
    metrics = [h for h in trainer.state.log_history if "tools/failure_frequency" in h]
    assert metrics and metrics[0]["tools/failure_frequency"] > 0


# --- one role trained, the others behind an OpenAI-compatible URL ---------------------------


def fixed_player(role: str, messages: list[dict[str, str]]) -> str:
    """The fixed player of the untrained roles: says say's word, proposes two plan-path moves."""
    words = WORD.findall(messages[-1]["content"])
    return words[-1] if words else "#### [D, R]"


@pytest.fixture
def openai_server() -> Any:
    """A loopback server speaking OpenAI's chat completions, played by `fixed_player`."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body["model"])
            reply = fixed_player(body["model"], body["messages"])
            data = json.dumps(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body["model"],
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": reply},
                            "finish_reason": "stop",
                        }
                    ],
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", seen
    server.shutdown()
    server.server_close()


def test_one_role_trained_the_others_behind_a_url(
    tiny_path: str, tmp_path: Path, openai_server: Any
) -> None:
    url, seen = openai_server
    game = environment("say", role="second", others=url)
    trainer = ScriptedTrainer(
        model=tiny_path,
        processing_class=tool_tokenizer(tiny_path),
        args=config(
            tmp_path, per_device_train_batch_size=5, num_generations=5, max_completion_length=256
        ),
        train_dataset=game.dataset(4),
        reward_funcs=game.reward,
        environment_factory=game.factory,
    )
    trainer.train()
    assert seen and set(seen) == {"first"}  # the fixed player is asked as its role

    rows = logged_rows(trainer, game.reward.__name__)
    check_replay(rows, "say", {}, role="second", others=fixed_player)
    by_reward = sorted(row["reward"] for row in rows)
    # Only the trained role's return: 1 for saying the word (first's hits are not ours).
    assert by_reward == [0.0, 1.0, 1.0, 1.0, 1.0]


# --- what a trainer can read, and bad input -------------------------------------------------


def test_dataset_holds_prompt_and_seed_only() -> None:
    game = environment("math", single_agent=True)
    data = game.dataset(6, seed_start=10)
    assert data.column_names == ["prompt", "seed"]
    assert data["seed"] == list(range(10, 16))
    assert all(p == data["prompt"][0] for p in data["prompt"])  # no task data in any row
    env = game.factory()
    observation = env.reset(**data[0])
    answer = str(env._episode.env.task.answer)
    assert answer not in json.dumps(data.to_list())
    assert observation == masenvs_observation("math", {"single_agent": True}, 10)
    result = env.answer("\\boxed{-12345}")
    assert answer not in result
    # The tools TRL sees are the methods without a leading underscore: only `answer`.
    tools = [n for n in dir(type(env)) if not n.startswith("_") and callable(getattr(env, n))]
    assert sorted(tools) == ["answer", "reset"]


def masenvs_observation(name: str, options: dict[str, Any], seed: int) -> str:
    env = masenvs.make(name, **options)
    env.reset(seed=seed)
    return env.observe(env.acting)


def test_malformed_action_gets_the_env_penalty() -> None:
    options = {"size": 4, "tool_task": "propose"}
    env = environment("plan_path", **options).factory()
    env.reset(seed=3)
    env.answer("no moves here")
    reference = masenvs.make("plan_path", **options)
    reference.reset(seed=3)
    _, rewards, _, _, infos = reference.step({reference.acting: "no moves here"})
    assert env.reward == sum(rewards.values())
    assert infos["tool"]["reward_parts"]["agent"] == reference.config.format_penalty


def test_bad_input_fails_at_construction_with_one_clear_line() -> None:
    with pytest.raises(KeyError, match="unknown environment 'plan_pat'; did you mean 'plan_path'"):
        environment("plan_pat")
    with pytest.raises(ValueError, match="unknown option 'sizee' \\(did you mean 'size'\\?\\)"):
        environment("plan_path", sizee=4)
    with pytest.raises(ValueError, match="option size=1"):
        environment("plan_path", size=1)
    with pytest.raises(ValueError, match="'boss' is not one of them"):
        environment("plan_path", role="boss")
    with pytest.raises(ValueError, match="needs a player for \\['tool'\\]"):
        environment("plan_path", role="plan")
    with pytest.raises(ValueError, match="others plays the roles you do not train"):
        environment("plan_path", others="http://127.0.0.1:1/v1")


def test_a_move_after_the_end_is_an_error_message_not_a_crash() -> None:
    env = environment("say").factory()
    env.reset(seed=0)
    word = WORD.findall(masenvs_observation("say", {}, 0))[-1]
    env.answer(word)
    assert env.answer(word).startswith("The episode is over: solved")
    with pytest.raises(ValueError, match="The episode is over"):
        env.answer(word)
    assert env.reward == 2.0
    with pytest.raises(ValueError, match="call reset"):
        environment("say").factory().answer("hi")


def test_a_failing_fixed_player_stops_with_the_role_and_url() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    env = environment("say", role="second", others=url).factory()
    with pytest.raises(RuntimeError, match=f"the fixed player of 'first' at {url} failed"):
        env.reset(seed=0)

    calls: list[str] = []

    def fails_second_time(role: str, messages: list[dict[str, str]]) -> str:
        calls.append(role)
        if len(calls) > 1:
            raise ConnectionError("server went away")
        return "nope"

    env = environment("say", role="second", others=fails_second_time).factory()
    env.reset(seed=0)
    with pytest.raises(ConnectionError):
        env.answer("nope")  # played; then `first` cannot move
    with pytest.raises(RuntimeError, match="first has not moved yet"):
        env.answer("again")  # never played as `first`'s move
    game_reward = environment("say", role="second", others=fails_second_time).reward
    assert game_reward([env], [[{"role": "assistant", "content": "x"}]]) == [0.0]


# --- docs/integrations.md ------------------------------------------------------------------


def trl_examples() -> list[str]:
    page = (ROOT / "docs" / "integrations.md").read_text()
    section = page.split("## TRL", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def shrink(code: str, tmp_path: Path, **more: str) -> str:
    """The docs example at test size: the tiny model, two small steps, no saving."""
    swaps = {
        'load_model("smollm2-135m")': 'load_model("tiny")',
        '"runs/trl-plan-path"': repr(str(tmp_path / "out")),
        "max_steps=100": "max_steps=2, use_cpu=True, save_strategy='no'",
        "per_device_train_batch_size=8": "per_device_train_batch_size=2",
        "num_generations=4": "num_generations=2",
        "max_completion_length=512": "max_completion_length=16",
        "dataset(400)": "dataset(4)",
        **more,
    }
    for old, new in swaps.items():
        assert old in code, f"the docs example no longer has {old!r}"
        code = code.replace(old, new)
    return code


@pytest.fixture
def masenvs_serve() -> Any:
    """`masenvs serve --model tiny --route tool=base` on a free loopback port, as the docs say."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = ["masenvs", "serve", "--model", "tiny", "--route", "tool=base", "--port", str(port)]
    server = subprocess.Popen(
        [sys.executable, "-m", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert server.stdout is not None
        for line in server.stdout:
            if "listening:" in line:
                break
        else:
            pytest.fail("masenvs serve exited before listening")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_docs_examples_run(tmp_path: Path, masenvs_serve: str) -> None:
    every_role, one_role = trl_examples()
    scope: dict[str, Any] = {}
    exec(shrink(every_role, tmp_path), scope)
    assert scope["trainer"].state.global_step == 2
    scope = {}
    url = masenvs_serve
    exec(shrink(one_role, tmp_path, **{'"http://127.0.0.1:8000/v1"': repr(url)}), scope)
    trainer = scope["trainer"]
    assert trainer.state.global_step == 2
    # The served model played `tool`: the rewards are still the env's for those moves.
    for row in logged_rows(trainer, "plan_path"):
        options = {"size": 4, "tool_task": "propose"}
        expected, _, first = replay(
            "plan_path", options, row["seed"], row["completion"], "plan", openai_player(url)
        )
        assert row["reward"] == pytest.approx(expected, abs=1e-5)
        assert row["prompt"][-1]["content"] == first
