"""Verilog tasks and their judge: Icarus Verilog simulations and Python reference models,
both run in the sandbox.

A task is a module header (ports), a spec, a hidden golden module and hidden stimulus
vectors with the golden's outputs. A testbench we generate drives one stimulus sequence per
vvp run and prints the design's outputs after each vector, on lines that start with a random
marker the design cannot know. Sequential designs: a vector is one clock cycle, inputs are
set while `clk` is low and outputs are read 1 time unit after the rising edge.
Combinational designs: outputs are read 5 time units after the inputs change.

Outputs are compared bit by bit as `%b` text; an `x` in an expected value is a don't-care
(as VerilogEval's testbenches do), any `x` or `z` the design gives elsewhere is a mismatch.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any

from masenvs.sandbox import Sandbox, SandboxLimits, Verdict, default_sandbox
from masenvs.tasks._verilog_harness import check_design
from masenvs.tasks.verilog_models import (
    MODEL_DRIVER,
    ModelRun,
    Outputs,
    Vector,
    model_request,
    read_model_run,
)

STATUSES = (
    "pass",
    "wrong",
    "compile_error",
    "forbidden",
    "timeout",
    "output_limit",
    "ended_early",
    "error",
)


@cache
def harness_source() -> str:
    return Path(__file__).with_name("_verilog_harness.py").read_text(encoding="utf-8")


# --- records ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Port:
    name: str
    direction: str  # "input" or "output"
    width: int = 1

    def declaration(self) -> str:
        width = f" [{self.width - 1}:0]" if self.width > 1 else ""
        return f"{self.direction}{width} {self.name}"


@dataclass(frozen=True)
class VerilogTask:
    """One problem. `vectors` and `expected` are hidden; `examples` leading vectors are shown."""

    id: str
    spec: str
    module: str
    ports: tuple[Port, ...]
    golden: str  # the reference module, named `module`; never shown to agents
    clock: str | None = None  # sequential designs: the clock input, toggled by the testbench
    vectors: tuple[Vector, ...] = ()
    expected: tuple[Outputs, ...] = ()
    examples: int = 4  # how many leading hidden vectors the prompt shows with their outputs
    source: str = "builtin"
    files: dict[str, str] = field(default_factory=dict, hash=False, compare=False)  # `include`s

    @property
    def sequential(self) -> bool:
        return self.clock is not None

    @property
    def inputs(self) -> tuple[Port, ...]:
        """Stimulus inputs (the clock is the testbench's)."""
        return tuple(p for p in self.ports if p.direction == "input" and p.name != self.clock)

    @property
    def outputs(self) -> tuple[Port, ...]:
        return tuple(p for p in self.ports if p.direction == "output")

    def header(self) -> str:
        ports = ",\n".join(f"    {p.declaration()}" for p in self.ports)
        return f"module {self.module} (\n{ports}\n);"

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "spec": self.spec,
            "module": self.module,
            "ports": [[p.name, p.direction, p.width] for p in self.ports],
            "golden": self.golden,
            "clock": self.clock,
            "vectors": [list(v) for v in self.vectors],
            "expected": [list(o) for o in self.expected],
            "examples": self.examples,
            "source": self.source,
            "files": dict(self.files),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VerilogTask:
        if not isinstance(data, dict):
            raise ValueError(f"a verilog task must be a JSON object, got {type(data).__name__}")
        missing = [k for k in ("id", "spec", "module", "ports", "golden") if not data.get(k)]
        if missing:
            raise ValueError(f"verilog task {data.get('id', '?')!r} has no {', '.join(missing)}")
        task = cls(
            id=str(data["id"]),
            spec=str(data["spec"]),
            module=str(data["module"]),
            ports=tuple(Port(str(n), str(d), int(w)) for n, d, w in data["ports"]),
            golden=str(data["golden"]),
            clock=data.get("clock"),
            vectors=tuple(tuple(int(x) for x in v) for v in data.get("vectors", ())),
            expected=tuple(tuple(str(x) for x in o) for o in data.get("expected", ())),
            examples=int(data.get("examples", 4)),
            source=str(data.get("source") or "custom"),
            files=dict(data.get("files") or {}),
        )
        if len(task.vectors) != len(task.expected):
            raise ValueError(
                f"verilog task {task.id!r}: {len(task.vectors)} vectors but "
                f"{len(task.expected)} expected outputs; regenerate its vectors"
            )
        return task


# --- comparison -------------------------------------------------------------------------------


def bits_match(got: str, expected: str) -> bool:
    """`got` equals `expected` bit by bit; `x` in `expected` is a don't-care."""
    return len(got) == len(expected) and all(e in "xX" or g == e for g, e in zip(got, expected))


def show_vector(task: VerilogTask, vector: Vector) -> str:
    return ", ".join(f"{p.name}={v}" for p, v in zip(task.inputs, vector))


def show_outputs(task: VerilogTask, outputs: Outputs) -> str:
    def one(bits: str) -> str:
        return str(int(bits, 2)) if bits and set(bits) <= {"0", "1"} else f"'b{bits}"

    return ", ".join(f"{p.name}={one(b)}" for p, b in zip(task.outputs, outputs))


# --- testbench --------------------------------------------------------------------------------

TB_TOP = "masenvs_tb"
PERIOD = 10  # time units per vector


def testbench(task: VerilogTask, sequences: Sequence[Sequence[Vector]], marker: str) -> str:
    """A testbench that plays sequence `+seq=N` and prints `marker i outputs` per vector."""
    inputs, outputs = task.inputs, task.outputs
    lines = ["`timescale 1ns/1ps", f"module {TB_TOP};"]
    if task.clock:
        lines.append(f"  reg {task.clock} = 1'b0;")
    for p in inputs:
        lines.append(f"  reg {_range(p)}{p.name};  // x until set, so `always @*` sees a change")
    for p in outputs:
        lines.append(f"  wire {_range(p)}{p.name};")
    conns = ", ".join(f".{p.name}({p.name})" for p in task.ports)
    lines += [f"  {task.module} dut ({conns});", "  integer seq;", "  initial begin"]
    lines.append('    if (!$value$plusargs("seq=%d", seq)) seq = 0;')
    fmt = " ".join(["%0d"] + ["%b"] * len(outputs))
    args = ", ".join(p.name for p in outputs)
    show = f'$display("{marker} {fmt}", i{", " + args if args else ""});'
    lines.append("    case (seq)")
    longest = 0
    for s, seq in enumerate(sequences):
        longest = max(longest, len(seq))
        lines.append(f"      {s}: begin")
        for i, vector in enumerate(seq):
            sets = " ".join(
                f"{p.name} = {p.width}'h{v & ((1 << p.width) - 1):x};"
                for p, v in zip(inputs, vector)
            )
            disp = show.replace(", i", f", {i}", 1)
            if task.clock:
                lines.append(f"        {sets} #5 {task.clock} = 1; #1 {disp} #4 {task.clock} = 0;")
            else:
                lines.append(f"        {sets} #5 {disp} #5;")
        lines.append("      end")
    lines += ["    endcase", f'    $display("{marker} done");', "    $finish;", "  end"]
    limit = (longest + 100) * PERIOD
    lines += [f'  initial begin #{limit}; $display("{marker} timeout"); $finish; end', "endmodule"]
    return "\n".join(lines) + "\n"


def _range(p: Port) -> str:
    return f"[{p.width - 1}:0] " if p.width > 1 else ""


# --- results ----------------------------------------------------------------------------------


@dataclass
class Mismatch:
    vector: int  # index in its sequence
    inputs: Vector
    expected: Outputs
    got: Outputs


@dataclass
class SimResult:
    """One design simulated on some sequences: its status and outputs, per sequence."""

    status: str  # "ok" or one of STATUSES' failures
    message: str = ""
    outputs: list[list[Outputs]] = field(default_factory=list)


@dataclass
class Check:
    """A design's outputs against expected ones on one sequence."""

    status: str  # one of STATUSES
    passed: int
    total: int
    message: str = ""  # compiler message, or why the run stopped
    first_mismatch: Mismatch | None = None

    @property
    def pass_rate(self) -> float:
        return self.passed / self.total if self.total else 0.0

    def describe(self, task: VerilogTask, limit: int = 600) -> str:
        """The verdict as feedback: what failed and where."""
        if self.status == "pass":
            return f"all {self.total} vectors pass"
        if self.status == "compile_error":
            return f"compile error:\n{_tail(self.message, limit)}"
        if self.status == "forbidden":
            return f"rejected before compiling: {self.message}"
        text = {
            "timeout": "simulation timeout (it never finished: a combinational loop, a "
            "zero-delay loop or a wait that never ends?)",
            "output_limit": "output limit: the simulation printed too much",
            "ended_early": "the simulation ended early ($finish or $stop in the design?)",
            "error": f"simulation error: {_tail(self.message, limit)}",
        }.get(self.status, f"{self.passed} of {self.total} vectors pass")
        if self.status != "wrong":
            text += f"; {self.passed} of {self.total} vectors passed before it stopped"
        m = self.first_mismatch
        if m is not None:
            step = "cycle" if task.sequential else "vector"
            text += (
                f"\nfirst mismatch at {step} {m.vector}: inputs {show_vector(task, m.inputs)}; "
                f"expected {show_outputs(task, m.expected)}, got {show_outputs(task, m.got)}"
            )
        return text


def _tail(text: str, limit: int) -> str:
    text = text.strip()
    return text if len(text) <= limit else "... " + text[-limit:]


def compare(
    result: SimResult, index: int, vectors: Sequence[Vector], expected: Sequence[Outputs]
) -> Check:
    """Run `index` of `result` against `expected` for `vectors`.

    Runs before the one that failed completed; that run and later ones get its status."""
    total = len(vectors)
    if index >= len(result.outputs):
        return Check(result.status, 0, total, result.message)
    rows = result.outputs[index]
    passed, first = 0, None
    for i, (vec, want) in enumerate(zip(vectors, expected)):
        got = rows[i] if i < len(rows) else None
        if got is not None and all(bits_match(g, w) for g, w in zip(got, want)):
            passed += 1
        elif first is None and got is not None:
            first = Mismatch(i, tuple(vec), tuple(want), tuple(got))
    status = "pass" if passed == total else "wrong"
    return Check(status, passed, total, result.message, first)


# --- the judge --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sim:
    """A design to simulate on stimulus sequences; `trusted` skips the rules (goldens)."""

    task: VerilogTask
    design: str
    sequences: tuple[tuple[Vector, ...], ...]
    trusted: bool = False


class VerilogJudge:
    """Simulates designs with Icarus Verilog and runs Python reference models, in the sandbox."""

    def __init__(
        self,
        sandbox: Sandbox | None = None,
        timeout: float = 10.0,
        max_output: int = 1 << 20,
        model_timeout: float = 5.0,
    ) -> None:
        self.sandbox = sandbox or default_sandbox()
        self.timeout = timeout  # wall seconds per design: compile plus every run
        self.max_output = max_output  # bytes a compile or a run may print
        self.model_timeout = model_timeout

    def _limits(self, n_sims: int) -> SandboxLimits:
        return replace(
            self.sandbox.limits,
            cpu_seconds=self.timeout * max(n_sims, 1),
            wall_seconds=self.timeout * max(n_sims, 1) + 5,
            memory_mb=max(self.sandbox.limits.memory_mb, 1024),
            max_output_bytes=max(self.max_output * 2 * max(n_sims, 1), 1 << 20),
        )

    def simulate(self, sims: Sequence[Sim]) -> list[SimResult]:
        """Trusted sims (goldens) in one sandbox run, the others in another; results in order.

        A golden never shares a run with a design: the design's run holds no golden source,
        in its files or its request, and the outputs are compared here, outside both."""
        if not sims:
            return []
        self.sandbox.check_judging("simulate designs against hidden vectors")
        results: list[SimResult] = [SimResult("error") for _ in sims]
        for trusted in (True, False):
            group = [i for i, s in enumerate(sims) if s.trusted == trusted]
            if not group:
                continue
            marker = "@" + secrets.token_hex(8)
            request = self._request([sims[i] for i in group], marker)
            run = self.sandbox.run(harness_source(), request, limits=self._limits(len(group)))
            if run.verdict != Verdict.OK:
                status = {"timeout": "timeout", "output_limit": "output_limit"}.get(
                    run.verdict, "error"
                )
                for i in group:
                    results[i] = SimResult(status, run.stderr[-2000:])
                continue
            for i, raw in zip(group, json.loads(run.stdout)):
                results[i] = _parse_sim(raw, marker, len(sims[i].task.outputs))
        return results

    def _request(self, sims: Sequence[Sim], marker: str) -> str:
        """The harness's request for `sims` in one run, each in its own directory."""
        request: dict[str, Any] = {"timeout": self.timeout, "max_output": self.max_output}
        request["sims"] = []
        for i, sim in enumerate(sims):
            files = {**sim.task.files, "design.v": sim.design}
            files["tb.v"] = testbench(sim.task, sim.sequences, marker)
            request["sims"].append(
                {
                    "dir": f"/tmp/sim{i}",
                    "files": files,
                    "checked": [] if sim.trusted else ["design.v"],
                    "includes": list(sim.task.files),
                    "compile": ["tb.v", "design.v"],
                    "top": TB_TOP,
                    "runs": [[f"+seq={s}"] for s in range(len(sim.sequences))],
                    "marker": marker,
                }
            )
        return json.dumps(request)

    def golden_outputs(
        self, task: VerilogTask, sequences: Sequence[Sequence[Vector]]
    ) -> list[list[Outputs]]:
        """The golden module's outputs on `sequences` (raises if the golden fails)."""
        (result,) = self.simulate([Sim(task, task.golden, tuple(map(tuple, sequences)), True)])
        if result.status != "ok" or any(
            len(o) != len(s) for o, s in zip(result.outputs, sequences)
        ):
            raise RuntimeError(
                f"the golden module of {task.id} failed ({result.status}): "
                f"{result.message.strip()[-500:]}; fix the task's golden module"
            )
        return result.outputs

    def check_design(self, task: VerilogTask, design: str) -> Check:
        """A design on the task's hidden vectors: pass, or the first failure."""
        (result,) = self.simulate([Sim(task, design, (task.vectors,))])
        return compare(result, 0, task.vectors, task.expected)

    def run_models(
        self,
        task: VerilogTask,
        code: str,
        sequences: Sequence[Sequence[Vector]],
        stimulus: bool = True,
    ) -> ModelRun:
        """A verifier's Python: its `stimulus()` (unless `stimulus` is False) and its
        `RefModel` on `sequences` plus that stimulus (last). Every failure of the code is a
        `ModelRun` with `status` != "ok", never a raise (a machine whose sandbox cannot hide
        the hidden vectors raises SandboxError).

        The run holds `sequences`: where they are hidden, what it returns besides the model's
        outputs on them (its stimulus, its messages) must not reach a prompt; run it once
        without them for that (the env does)."""
        self.sandbox.check_judging("run a verifier's model on hidden vectors")
        limits = replace(
            self.sandbox.limits,
            cpu_seconds=self.model_timeout,
            wall_seconds=self.model_timeout * 2 + 1,
            max_output_bytes=1 << 20,
        )
        ports = [[(p.name, p.width) for p in ps] for ps in (task.inputs, task.outputs)]
        request = model_request(*ports, sequences, stimulus)
        run = self.sandbox.run(code + MODEL_DRIVER, request, limits=limits)
        return read_model_run(run, [p.width for p in task.outputs], len(sequences))


def _parse_sim(raw: dict, marker: str, n_outputs: int) -> SimResult:
    """The harness's answer as rows of outputs per completed run; a run that hit the
    testbench's time limit or ended without its last line stops the list there."""
    result = SimResult(raw["status"], raw.get("message", ""))
    for text in raw.get("outputs", []):
        rows: list[Outputs] = []
        end = None
        for line in text.splitlines():
            parts = line.split()[1:]
            if parts in (["done"], ["timeout"]):
                end = parts[0]
                break
            if len(parts) == 1 + n_outputs and parts[0].isdigit():
                rows.append(tuple(parts[1:]))
        if end != "done":
            result.status = "timeout" if end == "timeout" else "ended_early"
            break
        result.outputs.append(rows)
    return result


def design_problem(text: str, task: VerilogTask) -> str | None:
    """Why a design cannot be compiled (forbidden system call, `include outside the task)."""
    return check_design(text, tuple(task.files))


__all__ = [
    "Check",
    "Mismatch",
    "Port",
    "Sim",
    "SimResult",
    "VerilogJudge",
    "VerilogTask",
    "bits_match",
    "compare",
    "design_problem",
    "testbench",
]
