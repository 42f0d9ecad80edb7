"""Auto-MAS (MetaAgent-X): a designer writes a multi-agent system, an executor runs it.

Roles: `designer` acts through `step`: its action is Python that builds a system from
`masenvs.mas` blocks. The `executor` plays every agent node of that system: it acts
inside the step, through the capture endpoint (`endpoint_url`), so the trainer serves and
trains it like any agent (`env.callers`). Each design runs `executions` (N) times in the
sandbox with no network; its LLM calls leave only through its execution's gate.

Rewards (the reward function first, as in every env):
- an execution scores its correctness (math-verify, or the pass ratio on the hidden code
  tests), plus a small `answer_bonus` when it states an answer (a boxed answer or a
  program); a design that fails to run scores 0 and the cause is recorded;
- the executor's calls of one execution share that execution's score;
- the designer's reward is the mean over its N executions.
Success: at least half of the executions are correct. Single-agent mode: one policy
plays both, the designs' calls go to the `designer` policy.
"""

from __future__ import annotations

import hashlib
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from masenvs.env import EnvConfig, EpisodeState, MASEnv, Message, RewardParts
from masenvs.mas.blocks import answer_of
from masenvs.mas.compat import published
from masenvs.mas.design import DesignRun, DesignRunner, extract_design
from masenvs.mas.llm import EXECUTOR
from masenvs.parsing import clip_text, last_code_block
from masenvs.sampling_args import SamplingArgs
from masenvs.tasks.loaders import TaskSource, open_source, task_from_dict
from masenvs.tasks.records import CodeTask, MathTask

HARNESS_DEFAULTS = {"max_rounds": 1, "temperature": 0.0, "repetition_penalty": 1.2}


class AutoMASConfig(EnvConfig):
    harness: Literal["masenvs", "published"] = Field(
        "masenvs",
        description="Which harness prompts the designer and runs its designs. masenvs: our "
        "block library and example, every design form, ToolAgent nodes. published: the "
        "published MetaAgent-X harness (docs/auto-mas.md, 'Two harnesses'): its designer and "
        "node prompts, tool output and extraction, its AgentNode loop, only `workflow = "
        "Workflow(...)` scripts run; max_rounds 1, executors greedy with repetition "
        "penalty 1.2 unless set.",
    )
    task: Literal["math", "code", "mixed"] = Field(
        "math",
        description="What the designed systems solve; mixed: math and code tasks drawn at "
        "math_ratio, as the published system trains (its mixed_env).",
    )
    source: str | None = Field(
        None,
        description='Task source as in the math/code envs (None: "generated" math, "builtin" code).',
    )
    split: str | None = Field(None, description="Dataset split (None: the dataset's default).")
    data_path: str | None = Field(None, description="A local copy of the hf: dataset.")
    level: int = Field(1, ge=1, le=3, description="Difficulty of generated math problems.")
    math_ratio: float = Field(
        0.5, ge=0, le=1, description="task: mixed: the share of math tasks (the rest is code)."
    )
    math_source: str | None = Field(
        None, description='task: mixed: the math source (None: "generated").'
    )
    code_sources: dict[str, float] | None = Field(
        None,
        description="task: mixed: code sources and their weights within the code share (None: "
        '{"builtin": 1}); the published apps_ratio 0.7 is {"hf:apps": 0.7, '
        '"hf:code_contests": 0.3}.',
    )
    data_paths: dict[str, str] = Field(
        default_factory=dict,
        description="task: mixed: local copies of hf: sources, by source name.",
    )
    max_rounds: int = Field(
        2, ge=1, le=100, description="Designs per episode; later ones see the last one's results."
    )
    executions: int = Field(
        4, ge=1, le=64, description="Runs of each design: N of the paper's M designs x N runs."
    )
    endpoint_url: str | None = Field(
        None,
        description="Root URL of the capture endpoint the executor is served at (the "
        "trainer sets it); without it every design fails with that cause.",
    )
    endpoint_api_key: str | None = Field(None, description="The endpoint's API key, if any.")
    executor_model: str = Field(
        EXECUTOR, description="The endpoint's model name for the executor policy."
    )
    max_calls: int = Field(16, ge=1, description="LLM calls one execution may make (budget).")
    max_tool_runs: int = Field(
        16, ge=0, description="Runs of the Python tool (ToolAgent nodes) one execution may make."
    )
    max_tokens: int | None = Field(
        256, description="Tokens per executor call.", **SamplingArgs.bounds("max_tokens")
    )
    temperature: float | None = Field(
        None,
        description="Executor temperature (None: the endpoint's default; harness published: 0).",
        **SamplingArgs.bounds("temperature"),
    )
    repetition_penalty: float | None = Field(
        None,
        description="Executor repetition penalty (None: the endpoint's default; harness "
        "published: 1.2, as its executors sample).",
        **SamplingArgs.bounds("repetition_penalty"),
    )
    design_seconds: float = Field(120.0, gt=0, description="Wall seconds of one execution.")
    design_memory_mb: int = Field(1024, ge=256, description="Memory of one execution's process.")
    correct_reward: float = Field(1.0, gt=0, description="Score of a correct execution.")
    answer_bonus: float = Field(
        0.05,
        ge=0,
        description="Added when an execution states an answer; at most 10% of "
        "correct_reward, so format never outweighs correctness.",
    )
    test_timeout: float = Field(5.0, gt=0, description="CPU seconds per hidden code test.")
    shown_chars: int = Field(1500, ge=200, description="How much of a result is shown back.")

    @model_validator(mode="before")
    @classmethod
    def _published_defaults(cls, data: Any) -> Any:
        """The published harness asks for one design and samples executors greedily with
        repetition penalty 1.2 (gen_agent.py:120-126; trainer/async_generate.py:451-458);
        temperature and penalty stay the user's to set."""
        if not isinstance(data, dict) or data.get("harness") != "published":
            return data
        if data.get("max_rounds", 1) != 1:
            raise ValueError(
                "harness: published asks the designer once (its prompt has no place for a "
                "last design's result): max_rounds must be 1"
            )
        return {**HARNESS_DEFAULTS, **data}

    @model_validator(mode="after")
    def _mixed_sources(self) -> AutoMASConfig:
        if self.task == "mixed" and (self.source or self.data_path):
            raise ValueError(
                "task: mixed takes math_source, code_sources and data_paths, not source or "
                "data_path"
            )
        if self.task != "mixed" and (self.math_source or self.code_sources or self.data_paths):
            raise ValueError("math_source, code_sources and data_paths are for task: mixed")
        return self

    @model_validator(mode="after")
    def _bonus_is_small(self) -> AutoMASConfig:
        if self.answer_bonus > 0.1 * self.correct_reward:
            raise ValueError(
                f"answer_bonus {self.answer_bonus} is over 10% of correct_reward "
                f"{self.correct_reward}: a format bonus must not outweigh correctness"
            )
        return self


# --- reward --------------------------------------------------------------------------------


def execution_score(correctness: float, answered: bool, cfg: AutoMASConfig) -> float:
    """One execution: correctness (0..1) times `correct_reward`, plus the small answer bonus."""
    return cfg.correct_reward * correctness + (cfg.answer_bonus if answered else 0.0)


def designer_reward(scores: list[float]) -> float:
    """The designer: the mean over its executions (a failed execution counts 0)."""
    return float(np.mean(scores)) if scores else 0.0


# --- prompts -------------------------------------------------------------------------------

LIBRARY = """\
Write Python in <code></code> tags that builds `system` from these blocks (already imported):
- Agent(name, system_prompt): one LLM call.
- Sequential(b1, b2, ...): each block sees the question and the previous answer.
- Ensemble(b1, b2, ..., judge=Agent(...)): independent answers, majority vote, judge on ties.
- Debate(b1, b2, ..., rounds=2, judge=Agent(...)): answers, then revisions after reading each other.
- Reflect(actor, critic, rounds=1): the critic checks, the actor revises until the critic says APPROVE.
- Router(Agent("router"), {"name": block, ...}): the router picks one block.
- Loop(block, max_iters=3): repeats until the answer has a \\boxed{}.
- ToolAgent(name, system_prompt, max_turns=4): an agent with a Python tool: each ```python
  block it writes is run (no network) and the output shown back, until it answers.
Every block gets the question and returns text. The final answer must be in \\boxed{}.
Scripts written against the `workflow` API (from workflow import AgentNode, Workflow,
ToolRegistry, ...) also run: the answer is the last `workflow.run(...)` result."""

EXAMPLE = """\
<code>
solver = Agent("solver", "Solve step by step. End with \\\\boxed{answer}.")
checker = Agent("checker", "Check the solution. Reply APPROVE if it is right.")
system = Reflect(solver, checker)
</code>"""

CODE_NOTE = (
    "The final answer must be a complete Python program in a ```python block, or in "
    "<solution></solution> tags (a ToolAgent's ```python blocks are run as tool calls)."
)


@dataclass
class Execution:
    rollout_id: str
    run: DesignRun
    correctness: float = 0.0
    answered: bool = False
    score: float = 0.0


@dataclass
class AutoMASState(EpisodeState):
    designs: list[dict[str, Any]] = field(default_factory=list)  # one summary per round


class AutoMASEnv(MASEnv):
    name = "auto_mas"
    roles = ("designer",)
    solo_role = "designer"
    config_class = AutoMASConfig

    config: AutoMASConfig
    task: MathTask | CodeTask
    state: AutoMASState

    def __init__(
        self, config: AutoMASConfig | None = None, render_mode: str | None = None, **kw: Any
    ):
        super().__init__(config, render_mode, **kw)
        self._instance = uuid.uuid4().hex
        cfg = self.config
        self.source: TaskSource
        if cfg.task == "mixed":
            self.source = _mixed_source(cfg)
        else:
            source = cfg.source or ("generated" if cfg.task == "math" else "builtin")
            self.source = open_source(source, cfg.task, cfg.split, cfg.data_path, cfg.level)

    @property
    def callers(self) -> list[str]:
        """The executor acts through the endpoint, not `step` (single-agent: the designer)."""
        return [] if self.config.single_agent else [self.config.executor_model]

    @property
    def executor_agent(self) -> str:
        """The agent (and endpoint model) whose policy plays the design's nodes."""
        return "designer" if self.config.single_agent else self.config.executor_model

    def generate_task(self, rng: np.random.Generator) -> MathTask | CodeTask:
        return self.source.sample(rng)

    def load_task(self, task: Any) -> MathTask | CodeTask:
        if isinstance(task, MathTask | CodeTask):
            return task
        if self.config.task == "mixed":
            return task_from_dict(task)  # a "prompt" makes it a code task
        return MathTask.from_dict(task) if self.config.task == "math" else CodeTask.from_dict(task)

    def initial_state(self, task: Any) -> AutoMASState:
        return AutoMASState()

    def task_info(self) -> dict[str, Any]:
        kind = "math" if isinstance(self.task, MathTask) else "code"
        return {"id": self.task.id, "source": self.task.source, "kind": kind}

    def question(self) -> str:
        if isinstance(self.task, MathTask):
            return self.task.question
        if self.config.harness == "published":  # the problem as it is (its nodes say <solution>)
            return self.task.prompt
        return f"{self.task.prompt}\n\n{CODE_NOTE}"

    def prompt(self, agent: str) -> list[Message]:
        cfg = self.config
        if cfg.harness == "published":  # gen_agent.py:123-124
            return [
                {"role": "system", "content": published.DESIGNER_SYSTEM},
                {"role": "user", "content": published.designer_user(self.question())},
            ]
        lines = [f"Task:\n{self.question()}", "", f"Design {self.round + 1} of {cfg.max_rounds}."]
        if self.state.designs:
            last = self.state.designs[-1]
            lines += [
                "",
                "Your last design:",
                f"<code>\n{clip_text(last['design'] or '(none)', cfg.shown_chars)}\n</code>",
            ]
            lines.append(f"Result: {last['summary']}")
        system = (
            "You design a team of LLM agents that solves the task below. "
            f"{LIBRARY}\n\nExample:\n{EXAMPLE}"
        )
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": "\n".join(lines)},
        ]

    # --- one design ---------------------------------------------------------------------------

    def play_turn(self, agent: str, action: str) -> RewardParts:
        published_harness = self.config.harness == "published"
        design = (published.extract_design if published_harness else extract_design)(action)
        design_id = self._design_id(action)
        executions: list[Execution] = []
        error = None
        if design is None:
            error = "no design: put the Python in <code></code> tags"
        else:
            executions = self._execute(design, design_id)
            failed = [e.run.error for e in executions if e.run.error]
            if len(failed) == len(executions):
                error = failed[0]
        scores = [e.score for e in executions]
        reward = designer_reward(scores)
        correct = sum(e.correctness >= 1.0 for e in executions)
        self.state.success = bool(executions) and correct * 2 >= len(executions)
        summary = error or (
            f"{correct} of {len(executions)} runs correct; answers: "
            + ", ".join(_short(e) for e in executions)
        )
        self.state.designs.append(
            {
                "design": design,
                "design_id": design_id,
                "error": error,
                "summary": summary,
                "executions": [_execution_info(e) for e in executions],
                "captured": [
                    {
                        "rollout_id": e.rollout_id,
                        "agent": self.executor_agent,
                        "reward": e.score,
                        "design_id": design_id,
                    }
                    for e in executions
                ],
                "graph": next((e.run.graph for e in executions if e.run.graph), None),
            }
        )
        self.last_feedback[agent] = summary
        return RewardParts(agent=reward)

    def _design_id(self, action: str) -> str:
        """Names the design's executions (rollout ids `mas-{id}-{m}`): the same for the same
        seed, round and action in this env, distinct across envs (two branches of a tree
        that sample the same design still run and record it separately)."""
        nonce = int(self._rng.integers(1 << 62))
        key = f"{self._instance}:{nonce}:{self.round}:{action}"
        return hashlib.sha1(key.encode("utf-8", "replace")).hexdigest()[:12]

    def _execute(self, design: str, design_id: str) -> list[Execution]:
        cfg = self.config
        runner = DesignRunner(
            cfg.endpoint_url,
            models={EXECUTOR: self.executor_agent},
            api_key=cfg.endpoint_api_key,
            max_calls=cfg.max_calls,
            max_tokens=cfg.max_tokens,
            temperature=cfg.temperature,
            seconds=cfg.design_seconds,
            memory_mb=cfg.design_memory_mb,
            max_tool_runs=cfg.max_tool_runs,
            task="math" if isinstance(self.task, MathTask) else "code",
            repetition_penalty=cfg.repetition_penalty,
            harness=cfg.harness,
        )
        messages = [{"role": "user", "content": self.question()}]
        ids = [f"mas-{design_id}-{m}" for m in range(cfg.executions)]
        with ThreadPoolExecutor(cfg.executions, thread_name_prefix="mas-exec") as pool:
            runs = list(pool.map(lambda rid: runner.run(design, messages, rid), ids))
        return [self._score(rid, run) for rid, run in zip(ids, runs)]

    def _score(self, rollout_id: str, run: DesignRun) -> Execution:
        cfg = self.config
        ex = Execution(rollout_id, run)
        if not run.ok or run.answer is None:
            return ex  # a failed design scores 0; run.error says why
        if isinstance(self.task, MathTask):
            from masenvs.tasks.math_judge import default_judge

            answer = answer_of(run.answer)
            ex.answered = answer is not None
            ex.correctness = float(
                answer is not None and default_judge().equal(self.task.answer, answer)
            )
        else:
            from masenvs.tasks.code_judge import CodeJudge

            code = solution_code(run.answer)
            ex.answered = code is not None
            if code is not None:
                task = self.task
                ex.correctness = (
                    CodeJudge(timeout=cfg.test_timeout)
                    .run(code, task.tests, task.fn_name)
                    .pass_rate
                )
        ex.score = execution_score(ex.correctness, ex.answered, cfg)
        return ex

    def _info(self, agent: str, parts: RewardParts | None) -> dict[str, Any]:
        info = super()._info(agent, parts)
        if parts is not None and self.state.designs:
            info.update(self.state.designs[-1])
        return info

    def render_text(self) -> str:
        if not self.state.designs:
            return f"auto_mas {self.task.id}: no design yet"
        last = self.state.designs[-1]
        graph = (last["graph"] or {}).get("structure", "no graph")
        return (
            f"auto_mas {self.task.id} design {len(self.state.designs)} [{graph}]: {last['summary']}"
        )


def _mixed_source(cfg: AutoMASConfig) -> TaskSource:
    from masenvs.tasks.mixed import mixed_math_code

    def one(spec: str, kind: Literal["math", "code"]) -> TaskSource:
        return open_source(spec, kind, cfg.split, cfg.data_paths.get(spec), cfg.level)

    code = cfg.code_sources or {"builtin": 1.0}
    return mixed_math_code(
        one(cfg.math_source or "generated", "math"),
        [(one(spec, "code"), weight) for spec, weight in code.items()],
        cfg.math_ratio,
    )


def solution_code(text: str) -> str | None:
    """A code answer: the last `<solution>...</solution>` (a fence inside unwrapped), as the
    published system's nodes write it, else the last ```python block."""
    start = text.rfind("<solution>")
    if start >= 0:
        end = text.find("</solution>", start)
        body = text[start + len("<solution>") : end if end >= 0 else len(text)]
        code = (last_code_block(body) or body).strip()
        if code:
            return code
    return last_code_block(text)


def _short(e: Execution) -> str:
    if e.run.error:
        return f"failed ({e.run.error[:60]})"
    answer = answer_of(e.run.answer or "") if e.answered else None
    mark = "correct" if e.correctness >= 1.0 else "wrong"
    return f"{(answer or '?')[:20]} ({mark})"


def _execution_info(e: Execution) -> dict[str, Any]:
    return {
        "rollout_id": e.rollout_id,
        "answer": (e.run.answer or "")[:500],
        "correctness": e.correctness,
        "score": e.score,
        "error": e.run.error,
        "calls": e.run.calls,
        "seconds": round(e.run.seconds, 3),
    }
