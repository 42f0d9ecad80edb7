"""A verifiers (0.4) taskset written the way verifiers' own are, for the tests of
masenvs.integrations.from_verifiers: each task asks for a word; a `@vf.reward` pays 1.0 when
the reply starts with it. verifiers imports it by id: `vf-say-taskset` -> `vf_say_taskset`."""

from __future__ import annotations

from collections.abc import Iterator

import verifiers.v1 as vf

WORDS = ["Yes", "No", "Maybe"]


class SayData(vf.TaskData):
    word: str  # the answer: read by the reward, never shown


class SayTask(vf.Task[SayData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def said_it(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.startswith(self.data.word))


class SayTasksetConfig(vf.TasksetConfig):
    words: list[str] = WORDS


class SayTaskset(vf.Taskset[SayTask, SayTasksetConfig]):
    def load(self) -> Iterator[SayTask]:
        for i, word in enumerate(self.config.words):
            yield SayTask(
                SayData(
                    name=f"say-{i}",
                    system_prompt="Answer with one word.",
                    prompt="Say the word that starts with the letter "
                    f"{word[0]!r} and has {len(word)} letters.",
                    word=word,
                ),
                self.config.task,
            )


__all__ = ["SayTaskset"]
