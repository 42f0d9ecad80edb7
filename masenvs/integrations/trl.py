"""TRL: any masenvs env as an `environment_factory` game for TRL's `GRPOTrainer`.

    game = environment("plan_path", size=4, tool_task="propose")
    GRPOTrainer(model=path, processing_class=tool_tokenizer(path), reward_funcs=game.reward,
                train_dataset=game.dataset(400), environment_factory=game.factory, args=...)

One TRL rollout is one episode. TRL calls `reset(**row)` with each dataset row (a fixed
instruction and the task `seed`); its string, the env's own observation of the policy's first
turn, becomes the user message. The policy moves by calling the tool `answer(text)`; the tool
returns the env's observation of its next turn, or how the episode ended. A reply that calls no
tool while the episode still runs is played as the policy's move when the rollout is scored, so
a model that never calls tools still plays one turn. The reward is `TextEpisode.reward`, the
env's own returns for those moves; its parts (process / agent / team), success and whether the
episode ended go to TRL's logs beside it.

Two ways to play a multi-agent env (see `TextEpisode`): `role=None`, the policy plays every
role in turn order; `role="plan", others=url`, the policy plays one role and a fixed player
behind an OpenAI-compatible URL (`masenvs serve`, vLLM) plays the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from masenvs.env import Message
from masenvs.integrations.episode import LEVELS, EpisodeOver, Player, TextEpisode, openai_player

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

RewardFunction = Callable[..., list[float]]


@dataclass(frozen=True)
class EpisodeSpec:
    """What each `Game` instance builds its `TextEpisode` from."""

    env: str
    options: dict[str, Any]
    role: str | None
    others: Player | None


class Game:
    """One masenvs episode as TRL sees it: `reset`, the tool `answer`, the reward read back.

    TRL exposes every public method as a tool, so everything but `reset` and `answer` is a
    property or private. `environment()` makes one subclass per env and options.
    """

    _spec: ClassVar[EpisodeSpec]

    def __init__(self) -> None:
        spec = self._spec
        self._episode = TextEpisode(spec.env, spec.options, spec.role, spec.others)
        self._started = False
        self._scored = False
        self._seed: int | None = None

    def reset(self, seed: int | None = None, **row: Any) -> str:
        """Start the episode of task `seed`; the env's observation of the policy's first turn."""
        self._started = True
        self._scored = False
        self._seed = seed
        try:
            return self._episode.reset(seed=seed).text
        except EpisodeOver:  # the other roles ended it before the policy's first turn
            return self._ending()

    def answer(self, text: str) -> str:
        """Give your answer to the current prompt; the environment plays it as your move.

        Args:
            text: Your answer, in the format the prompt asks for.

        Returns:
            The next prompt to answer, or how the episode ended.
        """
        if not self._started:
            raise ValueError(f"{self._spec.env}: no episode is running; call reset(seed=...) first")
        if self._episode.done:
            raise ValueError("The episode is over: no more moves are played. Stop here.")
        if not self._policy_moves():
            raise RuntimeError(
                f"{self._episode.env.acting} has not moved yet (its player failed): this "
                "episode cannot go on"
            )
        result = self._episode.step(str(text))
        return self._ending() if result.next is None else result.next.text

    @property
    def reward(self) -> float:
        """The episode's return for the policy, as the env gave it (`TextEpisode.reward`)."""
        return self._episode.reward

    @property
    def reward_parts(self) -> dict[str, float]:
        return self._episode.reward_parts

    @property
    def done(self) -> bool:
        return self._episode.done

    @property
    def success(self) -> bool:
        return self._episode.success

    @property
    def seed(self) -> int | None:
        return self._seed

    def _ending(self) -> str:
        outcome = "solved" if self._episode.success else "not solved"
        return f"The episode is over: {outcome}. Your return: {self._episode.reward:.4g}."

    def _policy_moves(self) -> bool:
        """Whether the acting role is the policy's (not so after the fixed player failed)."""
        acting = self._episode.env.acting
        return acting is not None and self._episode.trains(acting)

    def _score(self, completion: list[dict[str, Any]]) -> None:
        """Play the rollout's last reply if it called no tool and the episode still runs."""
        if self._scored:
            return
        self._scored = True
        last = completion[-1] if completion else None
        if (
            self._started
            and not self._episode.done
            and self._policy_moves()
            and last is not None
            and last.get("role") == "assistant"
            and not last.get("tool_calls")
        ):
            self._episode.step(str(last.get("content") or ""))


@dataclass(frozen=True)
class TRLEnvironment:
    """What `GRPOTrainer` needs for one masenvs env: `factory`, `reward`, `dataset(n)`."""

    name: str
    factory: type[Game]
    reward: RewardFunction
    instructions: str

    def dataset(self, n: int, seed_start: int = 0) -> Dataset:
        """`n` rows for `train_dataset`: the same instruction as the prompt, and the task seed
        (`seed_start`, `seed_start + 1`, ...). No task data: `reset` renders each task."""
        from datasets import Dataset

        prompt = [
            {"role": "system", "content": self.instructions},
            {"role": "user", "content": ""},  # TRL appends reset()'s observation here
        ]
        return Dataset.from_dict(
            {"prompt": [prompt] * n, "seed": list(range(seed_start, seed_start + n))}
        )


def environment(
    name: str,
    role: str | None = None,
    others: str | Player | None = None,
    **options: Any,
) -> TRLEnvironment:
    """A masenvs env (`name`, its `options`) for TRL.

    `role=None`: the policy plays every role. `role="plan", others=url`: it plays `plan`, and
    the fixed player behind the OpenAI-compatible `url` plays the others (or pass a player,
    e.g. `openai_player(url, model=...)`). Unknown envs, bad options or roles fail here.
    """
    if others is not None and role is None:
        raise ValueError(
            f"others plays the roles you do not train; pass role= (one of {name}'s roles) "
            "to train one role, or drop others to play every role"
        )
    player = _served_player(others) if isinstance(others, str) else others
    probe = TextEpisode(name, options, role, player)  # fails on bad names, options and roles
    roles = probe.env.possible_agents
    camel = "".join(part.title() for part in name.split("_"))
    factory = type(
        f"{camel}Game",
        (Game,),
        {"_spec": EpisodeSpec(name, dict(options), role, player)},
    )
    if role is None:
        instructions = f"You play every role of the {name} environment ({', '.join(roles)})"
    else:
        rest = ", ".join(r for r in roles if r != role)
        instructions = f"You play the {role} role of the {name} environment" + (
            f"; other players play {rest}" if rest else ""
        )
    instructions += (
        ". Each prompt is one turn: answer it by calling the tool `answer` with your answer. "
        "The tool returns your next prompt, until it says the episode is over."
    )
    return TRLEnvironment(name, factory, _reward_function(name), instructions)


def _served_player(url: str) -> Player:
    """`openai_player(url)`, whose failures name the role and the URL."""
    play = openai_player(url)

    def served(role: str, messages: list[Message]) -> str:
        try:
            return play(role, messages)
        except Exception as exc:
            raise RuntimeError(
                f"the fixed player of {role!r} at {url} failed ({exc}); start the server "
                "(e.g. `masenvs serve`) or fix others="
            ) from exc

    return served


def _reward_function(name: str) -> RewardFunction:
    def reward(
        environments: list[Game],
        completions: list[Any],
        log_metric: Callable[[str, float], None] | None = None,
        log_extra: Callable[[str, list[Any]], None] | None = None,
        **_: Any,
    ) -> list[float]:
        for game, completion in zip(environments, completions, strict=True):
            game._score(completion if isinstance(completion, list) else [])
        rewards = [game.reward for game in environments]
        columns: dict[str, list[Any]] = {
            level: [game.reward_parts[level] for game in environments] for level in LEVELS
        }
        columns["success"] = [game.success for game in environments]
        columns["done"] = [game.done for game in environments]
        if log_metric is not None:
            for column, values in columns.items():
                log_metric(f"{name}/{column}", sum(map(float, values)) / max(len(values), 1))
        if log_extra is not None:
            log_extra("seed", [game.seed for game in environments])
            for column, values in columns.items():
                log_extra(column, values)
        return rewards

    reward.__name__ = name  # TRL logs it as rewards/<name>/mean
    reward.__qualname__ = name
    return reward


def tool_tokenizer(model: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of the local model `model`, ready for TRL's tool calls: left padding, and
    where the model's own chat template cannot render tool calls but is ChatML (SmolLM2, the
    tiny test model), TRL's Qwen2.5 template, the same markers plus tool calls."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template, supports_tool_calling

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    if not supports_tool_calling(tokenizer):
        if "<|im_start|>" not in (tokenizer.chat_template or ""):
            raise ValueError(
                f"{model}: its chat template cannot render tool calls, which TRL's "
                "environment_factory needs; use a model whose template can (Qwen2.5, Qwen3, "
                "Llama 3.1) or set tokenizer.chat_template to one that does"
            )
        tokenizer.chat_template = qwen2_5_chat_template
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
