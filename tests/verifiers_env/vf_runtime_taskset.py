"""A verifiers taskset whose reward reads the sandbox the answer ran in: it cannot score from
a transcript, so masenvs refuses to wrap it (tests/verifiers_env/test_verifiers.py)."""

from __future__ import annotations

from collections.abc import Iterator

import verifiers.v1 as vf


class RuntimeTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def file_written(self, trace: vf.Trace, runtime: vf.Runtime) -> float:
        result = await runtime.run(["test", "-f", "answer.txt"], {})
        return float(result.exit_code == 0)


class RuntimeTaskset(vf.Taskset[RuntimeTask, vf.TasksetConfig]):
    def load(self) -> Iterator[RuntimeTask]:
        yield RuntimeTask(vf.TaskData(prompt="Write answer.txt."), self.config.task)


__all__ = ["RuntimeTaskset"]
