"""Verilog: design a hardware module from its spec; simulated with Icarus Verilog.

Roles, in turn order: `designer` writes the Verilog module from the spec and its header;
`verifier` then writes a Python reference model of the module and a test stimulus (the role
PettingLLMs' Verilog env trains). The designer sees, next round, where its design disagrees
with the verifier's model on that stimulus, and decides which side is wrong. Hidden vectors
(and the golden module's outputs on the verifier's stimulus) decide the designer's reward
and the team's success; the verifier is rewarded for a model that agrees with the golden
module on the hidden vectors. Single-agent mode: `designer` alone, with the spec's example
vectors as feedback. Judging: masenvs.tasks.verilog_judge (Icarus in the sandbox).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field

from masenvs.env import EnvConfig, EpisodeState, MASEnv, Message, RewardParts
from masenvs.parsing import clip_text, last_code_block
from masenvs.tasks.verilog_judge import (
    Check,
    Outputs,
    Sim,
    SimResult,
    Vector,
    VerilogJudge,
    VerilogTask,
    bits_match,
    compare,
    design_problem,
    show_outputs,
    show_vector,
)
from masenvs.tasks.verilog_loaders import open_verilog_source
from masenvs.tasks.verilog_models import MAX_STIMULUS


class VerilogConfig(EnvConfig):
    source: str = Field(
        "builtin",
        description='Task source: "builtin" (our problems), "verilogeval:DIR", "rtllm:DIR" or '
        '"jsonl:FILE" (VerilogTask.to_dict per line).',
    )
    kind: Literal["all", "combinational", "sequential"] = Field(
        "all", description="Which problems to draw."
    )
    sim_timeout: float = Field(
        10.0, gt=0, description="Wall seconds per design: compile plus every simulation."
    )
    model_timeout: float = Field(
        5.0, gt=0, description="CPU seconds for the verifier's Python model and stimulus."
    )
    pass_reward: float = Field(
        1.0, description="Designer's own reward: times its pass fraction on the judged vectors."
    )
    team_reward: float = Field(1.0, description="Both agents: times the design's pass fraction.")
    model_reward: float = Field(
        1.0, description="Verifier: when its model agrees with the golden on every hidden vector."
    )
    partial_model_reward: float = Field(
        0.5,
        description="Verifier: times its agreement fraction when its model runs but differs.",
    )
    format_penalty: float = Field(
        -1.0, description="For no ```verilog block (designer) or no ```python block (verifier)."
    )
    shown_chars: int = Field(3000, ge=200, description="How much of a design is shown back.")


# --- reward --------------------------------------------------------------------------------


def designer_reward(pass_rate: float | None, cfg: VerilogConfig) -> float:
    """The designer's own outcome: the pass fraction of its design on the hidden vectors plus
    the verifier's stimulus (golden outputs); the penalty when it wrote no module."""
    return cfg.format_penalty if pass_rate is None else cfg.pass_reward * pass_rate


def verifier_reward(agreement: float | None, wrote_code: bool, cfg: VerilogConfig) -> float:
    """Full marks when the reference model agrees with the golden on every hidden vector,
    partial (times the agreement) when it runs but differs, 0 when it fails to run."""
    if not wrote_code:
        return cfg.format_penalty
    if agreement is None:
        return 0.0
    return cfg.model_reward if agreement == 1.0 else cfg.partial_model_reward * agreement


def team_outcome(pass_rate: float, cfg: VerilogConfig) -> float:
    return cfg.team_reward * pass_rate


# --- prompts -------------------------------------------------------------------------------

DESIGN_LANGUAGES = ("verilog", "systemverilog", "v", "sv", "")

SYSTEM = {
    "designer": (
        "You are the design agent of a hardware team. Write the Verilog module that meets the "
        "spec in one ```verilog block, keeping the given module name and ports (outputs may be "
        "declared reg). A verifier agent writes a Python reference model and test stimulus; "
        "when your design disagrees with its model you see the inputs, its expected outputs "
        "and yours. The model can be wrong too: decide which side is wrong, then fix your "
        "design. Only arithmetic, sizing and $display-style system calls are allowed."
    ),
    "verifier": (
        "You are the verification agent of a hardware team. Write a Python reference model "
        "of the module in the spec, and a stimulus that exposes design mistakes, in one "
        "```python block. The designer's module and how it does on your stimulus are shown "
        "when available."
    ),
}
SOLO_SYSTEM = (
    "You design hardware. Write the Verilog module that meets the spec in one ```verilog "
    "block, keeping the given module name and ports (outputs may be declared reg). You see "
    "how it does on the examples and can fix it next round. Only arithmetic, sizing and "
    "$display-style system calls are allowed."
)
MODEL_FORMAT = (
    "Write, in one ```python block:\n"
    "```python\nclass RefModel:\n    def __init__(self):\n        ...  # state at power-on\n"
    "    def step(self, inputs: dict) -> dict:\n"
    "        ...  # inputs: {name: int}; return {output name: int}\n\n"
    "def stimulus() -> list[dict]:\n"
    f"    ...  # up to {MAX_STIMULUS} input vectors, e.g. [{{...}}, ...]\n```\n"
)


def timing_rules(task: VerilogTask) -> str:
    if not task.sequential:
        return (
            "The design is combinational. A test vector sets every input and reads the outputs; "
            "RefModel.step gets one vector and returns the outputs for it."
        )
    return (
        f"The design is sequential: it changes on the rising edge of {task.clock}, and a reset "
        "input is synchronous. A test vector is one clock cycle: the inputs are set while the "
        f"clock is low, {task.clock} rises, and the outputs are read just after the edge with "
        f"the inputs unchanged. RefModel.step gets one cycle's inputs (not {task.clock}) and "
        "returns the outputs just after that edge; a fresh RefModel is used per sequence and "
        "sequences start with reset."
    )


def examples_text(task: VerilogTask) -> str:
    step = "cycle" if task.sequential else "vector"
    lines = []
    for i, (vec, out) in enumerate(zip(task.vectors, task.expected)):
        if i >= task.examples:
            break
        lines.append(f"- {step} {i}: {show_vector(task, vec)} -> {show_outputs(task, out)}")
    return "\n".join(lines)


@dataclass
class VerilogState(EpisodeState):
    design: str | None = None  # the designer's latest module (the team's design)
    pass_rate: float = 0.0  # of `design` on the hidden vectors plus the verifier's stimulus
    hidden_check: Check | None = None
    model: str | None = None  # the verifier's latest Python
    stimulus: tuple[Vector, ...] = ()  # the verifier's latest stimulus
    stimulus_golden: tuple[Outputs, ...] = ()  # the golden's outputs on it
    stimulus_model: tuple[Outputs, ...] = ()  # the verifier's model's outputs on it
    agreement: float | None = None  # of the verifier's model with the golden, hidden vectors


class VerilogEnv(MASEnv):
    name = "verilog"
    roles = ("designer", "verifier")
    solo_role = "designer"
    config_class = VerilogConfig

    config: VerilogConfig
    task: VerilogTask
    state: VerilogState

    def __init__(
        self, config: VerilogConfig | None = None, render_mode: str | None = None, **kw: Any
    ):
        super().__init__(config, render_mode, **kw)
        cfg = self.config
        self.source = open_verilog_source(cfg.source, cfg.kind)
        self.judge = VerilogJudge(timeout=cfg.sim_timeout, model_timeout=cfg.model_timeout)

    def generate_task(self, rng: np.random.Generator) -> VerilogTask:
        return self.source.sample(rng)

    def load_task(self, task: Any) -> VerilogTask:
        return task if isinstance(task, VerilogTask) else VerilogTask.from_dict(task)

    def initial_state(self, task: VerilogTask) -> VerilogState:
        return VerilogState()

    def answer_action(self, answer: str) -> str:
        """A bare program is the program: fenced unless it is."""
        bare = answer.strip() and "```" not in answer
        return f"```\n{answer.strip()}\n```" if bare else answer

    def task_info(self) -> dict[str, Any]:
        return {
            "id": self.task.id,
            "source": self.task.source,
            "sequential": self.task.sequential,
            "hidden_vectors": len(self.task.vectors),
        }

    def prompt(self, agent: str) -> list[Message]:
        cfg, task, state = self.config, self.task, self.state
        system = SOLO_SYSTEM if cfg.single_agent else SYSTEM[agent]
        lines = [
            f"Spec:\n{task.spec}",
            "",
            f"Module header:\n```verilog\n{task.header()}\n```",
            timing_rules(task),
            "Examples:",
            examples_text(task),
        ]
        if agent == "verifier":
            lines += ["", MODEL_FORMAT.rstrip()]
        lines += ["", f"Round {self.round + 1} of {cfg.max_rounds}."]
        if agent == "designer" and state.design is not None:
            lines += [
                "Your last design:",
                f"```verilog\n{clip_text(state.design.strip(), cfg.shown_chars)}\n```",
            ]
        if agent == "verifier" and state.design is not None:
            lines += [
                "The designer's latest module:",
                f"```verilog\n{clip_text(state.design.strip(), cfg.shown_chars)}\n```",
            ]
        feedback = self.last_feedback.get(agent)
        if feedback:
            lines += ["", feedback]
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": "\n".join(lines)},
        ]

    # --- one round ----------------------------------------------------------------------------

    def play_turn(self, agent: str, action: str) -> RewardParts:
        if agent == "designer":
            return self._designer_turn(action)
        return self._verifier_turn(action)

    def _designer_turn(self, action: str) -> RewardParts:
        """The design is the team's: hidden vectors and the verifier's stimulus (golden
        outputs) decide its reward and the team's."""
        cfg, state = self.config, self.state
        design = last_code_block(action, DESIGN_LANGUAGES)
        if design is not None and "module" not in design:
            design = None
        if design is None:
            self.last_feedback["designer"] = (
                "No ```verilog block with a module found: put your whole module in one."
            )
            return RewardParts(
                agent=designer_reward(None, cfg), team=team_outcome(state.pass_rate, cfg)
            )
        hidden, on_stimulus, on_examples, on_model = self._judge_design(design)
        total = hidden.total + on_stimulus.total
        state.design = design
        state.hidden_check = hidden
        state.pass_rate = (hidden.passed + on_stimulus.passed) / total if total else 0.0
        if cfg.single_agent:  # with a verifier, the round ends at its turn (see below)
            state.success = state.pass_rate == 1.0
        self.last_feedback["designer"] = self._designer_feedback(hidden, on_examples, on_model)
        return RewardParts(
            agent=designer_reward(state.pass_rate, cfg),
            team=team_outcome(state.pass_rate, cfg),
        )

    def _judge_design(self, design: str) -> tuple[Check, Check, Check, Check | None]:
        """The design on the hidden vectors, the stimulus (golden), the examples and the
        stimulus again (against the verifier's model), from one simulation."""
        task, state = self.task, self.state
        sequences: tuple[tuple[Vector, ...], ...] = (task.vectors,)
        if state.stimulus:
            sequences += (state.stimulus,)
        problem = design_problem(design, task)
        if problem is not None:
            result = SimResult("forbidden", problem)
        else:
            (result,) = self.judge.simulate([Sim(task, design, sequences)])
        hidden = compare(result, 0, task.vectors, task.expected)
        k = task.examples
        examples = compare(result, 0, task.vectors[:k], task.expected[:k])
        on_stimulus = compare(result, 1, state.stimulus, state.stimulus_golden)
        on_model = None
        if state.stimulus:
            on_model = compare(result, 1, state.stimulus, state.stimulus_model)
        return hidden, on_stimulus, examples, on_model

    def _verifier_turn(self, action: str) -> RewardParts:
        """The verifier's model is checked against the golden on the hidden vectors; its
        stimulus is simulated on the golden (for the designer's reward) and on the design
        (for the designer's feedback)."""
        cfg, task, state = self.config, self.task, self.state
        code = last_code_block(action)
        # The episode ends after the round whose design passed everything, so the verifier
        # still gets its turn.
        state.success = state.design is not None and state.pass_rate == 1.0
        if code is None:
            self.last_feedback["verifier"] = "No ```python block found. " + MODEL_FORMAT
            return RewardParts(agent=verifier_reward(None, False, cfg))
        # Two runs: its stimulus and its model on it and on the examples, shown back, from a
        # run that holds no hidden vector; then its model on the hidden vectors, of which only
        # the agreement count comes back (a stimulus or message from that run could carry them).
        shown = self.judge.run_models(task, code, [task.vectors[: task.examples]])
        state.model = code
        hidden = shown
        if shown.status == "ok":
            hidden = self.judge.run_models(task, code, [task.vectors], stimulus=False)
        if hidden.status != "ok":
            state.agreement = None
            self.last_feedback["verifier"] = (
                f"Your model failed ({shown.status}): {shown.message}"
                if shown.status != "ok"
                else f"Your model failed on the hidden vectors ({hidden.status})."
            )
            return RewardParts(agent=verifier_reward(None, True, cfg))
        rows = hidden.outputs[0]
        agree = sum(
            all(bits_match(g, w) for g, w in zip(got, want))
            for got, want in zip(rows, task.expected)
        )
        state.agreement = agree / len(task.vectors) if task.vectors else 0.0
        lines = [
            f"Your model agrees with a correct design on {agree} of {len(task.vectors)} "
            "hidden vectors."
        ]
        lines += self._simulate_stimulus(shown.stimulus, shown.stimulus_outputs)
        self.last_feedback["verifier"] = "\n".join(lines)
        return RewardParts(agent=verifier_reward(state.agreement, True, cfg))

    def _simulate_stimulus(self, stimulus: tuple[Vector, ...], model: list[Outputs]) -> list[str]:
        """Golden and design on the new stimulus; feedback lines for the verifier."""
        task, state = self.task, self.state
        if not stimulus:
            return ["Your stimulus() gave no vectors; the designer is judged on hidden ones only."]
        sims = [Sim(task, task.golden, (stimulus,), trusted=True)]
        if state.design is not None and design_problem(state.design, task) is None:
            sims.append(Sim(task, state.design, (stimulus,)))
        results = self.judge.simulate(sims)
        golden = results[0]
        if golden.status != "ok" or not golden.outputs:
            return [f"The correct design could not run your stimulus ({golden.status})."]
        state.stimulus = stimulus
        state.stimulus_golden = tuple(golden.outputs[0])
        state.stimulus_model = tuple(model)
        lines = []
        validity = compare(golden, 0, stimulus, model)  # golden outputs against the model's
        if validity.first_mismatch is None:
            lines.append(f"On your {len(stimulus)} stimulus vectors a correct design agrees.")
        else:
            m = validity.first_mismatch
            lines.append(
                f"On your stimulus a correct design agrees with your model on {validity.passed} "
                f"of {len(stimulus)} vectors; first difference at vector {m.vector}: inputs "
                f"{show_vector(task, m.inputs)}; your model gives {show_outputs(task, m.expected)}"
                f", a correct design {show_outputs(task, m.got)}."
            )
        if len(results) > 1:
            on_design = compare(results[1], 0, stimulus, model)
            self.last_feedback["designer"] = (
                "Your design against the verifier's model on its stimulus: "
                + on_design.describe(task)
            )
            lines.append(
                "The designer's module against your model: "
                + on_design.describe(task).replace("expected", "your model gives")
            )
        return lines

    def _designer_feedback(self, hidden: Check, examples: Check, on_model: Check | None) -> str:
        task = self.task
        if hidden.status in ("compile_error", "forbidden"):
            return "Your design " + hidden.describe(task)
        if hidden.status in ("timeout", "output_limit", "ended_early", "error"):
            return "Your design stopped: " + hidden.describe(task).split("\nfirst mismatch")[0]
        lines = [f"Your design compiled. On the examples: {examples.describe(task)}"]
        if on_model is not None:
            lines.append("Against the verifier's model on its stimulus: " + on_model.describe(task))
        return "\n".join(lines)

    def _info(self, agent: str, parts: RewardParts | None) -> dict[str, Any]:
        info = super()._info(agent, parts)
        info["pass_rate"] = self.state.pass_rate
        info["verifier_agreement"] = self.state.agreement
        check = self.state.hidden_check
        info["design_status"] = None if check is None else check.status
        return info

    def render_text(self) -> str:
        s = self.state
        status = "solved" if s.success else f"round {self.round}"
        agreement = "n/a" if s.agreement is None else f"{s.agreement:.2f}"
        verdict = "no design" if s.hidden_check is None else s.hidden_check.status
        return (
            f"verilog {self.task.id} ({status}): design {verdict}, pass rate {s.pass_rate:.2f}, "
            f"{len(s.stimulus)} stimulus vectors, verifier agreement {agreement}"
        )
