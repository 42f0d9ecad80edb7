"""Say: the RL sanity check. Every agent is paid for saying a word; nothing else counts.

`task: fixed` is a bandit with one fixed answer (`target`): a trainer that works takes any
policy that says it sometimes to saying it always, in a few steps. `task: echo` draws a new
made-up word for every task and asks for it back: a rule (copy the word) that a small model
follows sometimes and can learn, measured on held-out words. Roles `first` and `second` see
the same prompt and are scored alone, so every policy mode (shared, per-agent) is exercised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import Field

from masenvs.env import EnvConfig, EpisodeState, MASEnv, Message, RewardParts


class SayConfig(EnvConfig):
    task: Literal["fixed", "echo"] = Field(
        "echo",
        description="'fixed': every task asks for `target` (a bandit); 'echo': every task asks "
        "for a new made-up word drawn from the task seed (a rule to learn: repeat the word).",
    )
    target: str = Field("Yes", min_length=1, description="The word to say (task 'fixed').")
    case_sensitive: bool = Field(False, description="Whether 'yes' counts for 'Yes'.")
    hit: float = Field(1.0, description="Agent reward for an answer that starts with the word.")
    miss: float = Field(0.0, description="Agent reward for any other answer.")


# --- reward --------------------------------------------------------------------------------

_FRAME = " \t\r\n\"'`*_.,:;!?()[]<>#-"  # quotes, markdown and punctuation around a word


def said(answer: str, word: str, case_sensitive: bool = False) -> bool:
    """Whether `answer` starts with `word`, ignoring whitespace, quotes and markdown around it."""
    text, word = answer.lstrip(_FRAME), word.strip(_FRAME)
    if not case_sensitive:
        text, word = text.lower(), word.lower()
    return bool(word) and text.startswith(word)


# --- task ----------------------------------------------------------------------------------

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def made_up_word(rng: np.random.Generator) -> str:
    """Two or three consonant-vowel syllables, e.g. 'kavo', 'zemiru': new to any model."""
    syllables = int(rng.integers(2, 4))
    return "".join(
        _CONSONANTS[int(rng.integers(len(_CONSONANTS)))] + _VOWELS[int(rng.integers(len(_VOWELS)))]
        for _ in range(syllables)
    )


@dataclass(frozen=True)
class SayTask:
    word: str


# --- prompts -------------------------------------------------------------------------------

SYSTEM = "You answer with exactly one word and nothing else."


@dataclass
class SayState(EpisodeState):
    hits: dict[str, bool] = field(default_factory=dict)  # this round: who said the word


class SayEnv(MASEnv):
    name = "say"
    roles = ("first", "second")
    solo_role = "first"
    config_class = SayConfig

    config: SayConfig
    task: SayTask
    state: SayState

    def generate_task(self, rng: np.random.Generator) -> SayTask:
        return SayTask(self.config.target if self.config.task == "fixed" else made_up_word(rng))

    def load_task(self, task: Any) -> SayTask:
        if isinstance(task, SayTask):
            return task
        word = task.get("word") if isinstance(task, dict) else task
        if not isinstance(word, str) or not word.strip(_FRAME):
            raise ValueError(f"a say task is a word or {{'word': ...}}, got {task!r}")
        return SayTask(word)

    def initial_state(self, task: SayTask) -> SayState:
        return SayState()

    def task_info(self) -> dict[str, Any]:
        return {"word": self.task.word}

    def prompt(self, agent: str) -> list[Message]:
        # The same words for every role: one target, so the policy modes compare alike.
        return [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Say {self.task.word}."},
        ]

    def play_turn(self, agent: str, action: str) -> RewardParts:
        cfg, state = self.config, self.state
        if agent == self.agents[0]:
            state.hits = {}  # a new round
        hit = said(action, self.task.word, cfg.case_sensitive)
        state.hits[agent] = hit
        self.last_feedback[agent] = "Right." if hit else f"The word was {self.task.word}."
        if len(state.hits) == len(self.agents) and all(state.hits.values()):
            state.success = True
        return RewardParts(agent=cfg.hit if hit else cfg.miss)

    def render_text(self) -> str:
        status = "solved" if self.state.success else f"round {self.round}"
        return f"say {self.task.word!r} ({status}): {self.state.hits}"
