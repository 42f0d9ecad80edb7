"""Verilog task sources: our problems, VerilogEval and RTLLM from local files, our JSONL.

* `builtin`: masenvs' own problems (`verilog_problems.py`).
* `verilogeval:DIR`: VerilogEval v2 (spec-to-rtl), or v1 (`VerilogEval_Human.jsonl`, see
  `load_verilogeval_v1`): `ProbNNN_name_prompt.txt` (the spec) and
  `ProbNNN_name_ref.sv` (the reference module `RefModule`, renamed to the `TopModule` the
  prompt asks for). Its `_test.sv` testbenches are not used.
* `rtllm:DIR`: RTLLM: one folder per design holding `design_description.txt` and
  `verified_<name>.v` (the reference, module `<name>`); other `.v`/`.vh` files of the folder
  may be `include`d. Its `testbench.v` is not used.
* `jsonl:FILE`: `VerilogTask.to_dict()` per line.

Loaded references have no stored vectors: masenvs parses their ports, draws seeded random
stimulus (`verilog_problems.stimulus`) and simulates the reference for the hidden outputs,
once per process. An `x` the reference gives is a don't-care.
"""

from __future__ import annotations

import ast
import json
import operator
import re
import warnings
from functools import lru_cache
from pathlib import Path

import numpy as np

from masenvs.tasks.loaders import TaskList
from masenvs.tasks.records import TaskSourceError
from masenvs.tasks.verilog_judge import Port, Sim, VerilogJudge, VerilogTask
from masenvs.tasks.verilog_problems import builtin_tasks, seed_of, stimulus

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
_MODULE = re.compile(
    r"\bmodule\s+(\w+)\s*(#\s*\((?P<params>.*?)\)\s*)?\((?P<ports>.*?)\)\s*;", re.S
)
_PARAM = re.compile(
    r"\b(?:parameter|localparam)\b(?:\s+(?:integer|int|signed|\[[^\]]*\]))*\s+(\w+)\s*=\s*([^,;)]+)"
)
_DECL = re.compile(
    r"\b(input|output|inout)\b\s*(?:wire|reg|logic|var)?\s*(?:signed|unsigned)?\s*(\[[^\]]*\])?\s*([^;]*);"
)
_CLOCKS = ("clk", "clock", "clk_i", "i_clk", "clk_in", "CLK")


def parse_module(text: str) -> tuple[str, tuple[Port, ...]]:
    """The first module's name and ports (ANSI or non-ANSI headers; widths may use
    parameters). Raises ValueError naming what could not be read."""
    text = _COMMENTS.sub(" ", text)
    match = _MODULE.search(text)
    if not match:
        raise ValueError("no `module name (...);` header found")
    name = match.group(1)
    params = {}
    for pname, expr in _PARAM.findall(text):
        try:
            params[pname] = _eval(expr, params)
        except ValueError:
            continue
    ports: list[Port] = []
    header = match.group("ports")
    if re.search(r"\b(input|output|inout)\b", header):
        direction, width = None, 1
        for item in _split_top(header):
            found = re.match(
                r"\s*(input|output|inout)?\s*(?:wire|reg|logic|var)?\s*(?:signed|unsigned)?\s*"
                r"(\[[^\]]*\])?\s*(\w+)\s*$",
                item,
            )
            if not found:
                raise ValueError(f"cannot read the port {item.strip()[:60]!r}")
            if found.group(1):
                direction, width = found.group(1), _width(found.group(2), params)
            elif found.group(2):
                width = _width(found.group(2), params)
            if direction is None:
                raise ValueError(f"port {found.group(3)} has no direction")
            ports.append(Port(found.group(3), direction, width))
    else:
        names = [n.strip() for n in header.split(",") if n.strip()]
        declared = {}
        for direction, rng, rest in _DECL.findall(text[match.end() :]):
            for item in rest.split(","):
                item = item.strip().split("=")[0].strip()
                if item.isidentifier():
                    declared[item] = Port(item, direction, _width(rng, params))
        missing = [n for n in names if n not in declared]
        if missing:
            raise ValueError(f"ports {missing} are not declared input or output")
        ports = [declared[n] for n in names]
    if any(p.direction == "inout" for p in ports):
        raise ValueError("inout ports are not supported")
    return name, tuple(ports)


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        depth += ch in "[({"
        depth -= ch in "])}"
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p for p in parts if p.strip()]


def _width(rng: str | None, params: dict[str, int]) -> int:
    if not rng:
        return 1
    hi, _, lo = rng.strip()[1:-1].partition(":")
    return abs(_eval(hi, params) - _eval(lo, params)) + 1


_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Div: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.LShift: operator.lshift,
}


def _eval(expr: str, params: dict[str, int]) -> int:
    """An integer constant expression of numbers, parameters and + - * / % ** <<."""
    expr = re.sub(r"\d*'[sS]?[dD](\d+)", r"\1", expr.strip())
    expr = re.sub(r"\$clog2", "clog2", expr)

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and node.id in params:
            return params[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "clog2":
            return max(int(ev(node.args[0]) - 1).bit_length(), 0)
        raise ValueError(f"cannot evaluate {expr!r}")

    try:
        return ev(ast.parse(expr, mode="eval").body)
    except (SyntaxError, TypeError, ZeroDivisionError, IndexError) as exc:
        raise ValueError(f"cannot evaluate {expr!r}") from exc


# --- tasks from references --------------------------------------------------------------------


def task_from_reference(
    task_id: str,
    spec: str,
    golden: str,
    source: str,
    files: dict[str, str] | None = None,
) -> VerilogTask:
    """A task without vectors yet: ports and clock read from the reference module."""
    module, ports = parse_module(golden)
    clock = next((p.name for p in ports if p.direction == "input" and p.name in _CLOCKS), None)
    return VerilogTask(
        id=task_id,
        spec=spec.strip(),
        module=module,
        ports=ports,
        golden=golden,
        clock=clock,
        examples=8 if clock else 4,
        source=source,
        files=dict(files or {}),
    )


def with_vectors(tasks: list[VerilogTask], judge: VerilogJudge | None = None) -> list[VerilogTask]:
    """Each task with seeded random stimulus and its reference's outputs; tasks whose
    reference fails to simulate are left out with a warning."""
    judge = judge or VerilogJudge()
    done = []
    for start in range(0, len(tasks), 16):
        batch = tasks[start : start + 16]
        vectors = [tuple(stimulus(t, np.random.default_rng(seed_of(t.id)))) for t in batch]
        sims = [Sim(t, t.golden, (v,), trusted=True) for t, v in zip(batch, vectors)]
        for task, vecs, result in zip(batch, vectors, judge.simulate(sims)):
            if result.status != "ok" or len(result.outputs[0]) != len(vecs):
                warnings.warn(
                    f"skipping {task.id}: its reference did not simulate ({result.status}: "
                    f"{result.message.strip()[-200:]})",
                    stacklevel=2,
                )
                continue
            done.append(
                VerilogTask(
                    **{**task.__dict__, "vectors": vecs, "expected": tuple(result.outputs[0])}
                )
            )
    return done


def load_verilogeval(directory: str | Path) -> list[VerilogTask]:
    """VerilogEval problems from a local copy: v2's spec-to-rtl folder, or v1's JSONL."""
    root = Path(directory)
    prompts = sorted(root.rglob("*_prompt.txt"))
    if not prompts:
        v1 = sorted(root.rglob("VerilogEval_*.jsonl"))
        if v1:
            return load_verilogeval_v1(v1[0])
        raise TaskSourceError(
            f"no *_prompt.txt or VerilogEval_*.jsonl under {root}: point verilogeval: at "
            "VerilogEval v2's dataset_spec-to-rtl folder or v1's data folder"
        )
    tasks = []
    for prompt in prompts:
        stem = prompt.name[: -len("_prompt.txt")]
        ref = next(
            (
                prompt.with_name(f"{stem}_ref{ext}")
                for ext in (".sv", ".v")
                if prompt.with_name(f"{stem}_ref{ext}").is_file()
            ),
            None,
        )
        if ref is None:
            warnings.warn(f"skipping {stem}: no {stem}_ref.sv beside its prompt", stacklevel=2)
            continue
        golden = re.sub(r"\bRefModule\b", "TopModule", ref.read_text(encoding="utf-8"))
        try:
            tasks.append(
                task_from_reference(stem, prompt.read_text(encoding="utf-8"), golden, "verilogeval")
            )
        except ValueError as exc:
            warnings.warn(f"skipping {stem}: {exc}", stacklevel=2)
    return tasks


def load_verilogeval_v1(path: Path) -> list[VerilogTask]:
    """VerilogEval v1: `VerilogEval_Human.jsonl` (task_id, prompt = the module header,
    canonical_solution = the rest of the golden) with the spec from the
    `VerilogDescription_*.jsonl` beside it or under a `descriptions` folder (else the header)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    specs: dict[str, str] = {}
    for desc in sorted(path.parent.parent.rglob("VerilogDescription_*.jsonl")):
        for line in desc.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                specs.setdefault(row["task_id"], row.get("detail_description", ""))
    tasks = []
    for row in rows:
        golden = row["prompt"] + row["canonical_solution"]
        spec = specs.get(row["task_id"]) or row["prompt"]
        try:
            tasks.append(task_from_reference(row["task_id"], spec, golden, "verilogeval"))
        except ValueError as exc:
            warnings.warn(f"skipping {row['task_id']}: {exc}", stacklevel=2)
    return tasks


def load_rtllm(directory: str | Path) -> list[VerilogTask]:
    """RTLLM designs from a local copy of the benchmark (one folder per design)."""
    root = Path(directory)
    descriptions = sorted(root.rglob("design_description.txt"))
    if not descriptions:
        raise TaskSourceError(
            f"no design_description.txt under {root}: point rtllm: at a copy of RTLLM"
        )
    tasks = []
    for desc in descriptions:
        folder = desc.parent
        refs = sorted(folder.glob("verified_*.v")) + sorted(folder.glob("verified_*.sv"))
        if not refs:
            warnings.warn(f"skipping {folder.name}: no verified_*.v reference", stacklevel=2)
            continue
        files = {
            f.name: f.read_text(encoding="utf-8", errors="replace")
            for f in sorted(folder.iterdir())
            if f.suffix in (".v", ".vh", ".svh", ".sv")
            and f not in refs  # a second reference is a golden too: never a design's file
            and not f.name.startswith(("testbench", "tb"))
        }
        golden = refs[0].read_text(encoding="utf-8", errors="replace")
        try:
            tasks.append(
                task_from_reference(
                    str(folder.relative_to(root)),
                    desc.read_text(encoding="utf-8", errors="replace"),
                    golden,
                    "rtllm",
                    files,
                )
            )
        except ValueError as exc:
            warnings.warn(f"skipping {folder.name}: {exc}", stacklevel=2)
    return tasks


def read_verilog_jsonl(path: str | Path) -> list[VerilogTask]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    tasks = [VerilogTask.from_dict(r) for r in rows]
    ready = [t for t in tasks if t.vectors]
    return ready + with_vectors([t for t in tasks if not t.vectors])


@lru_cache(maxsize=16)
def load_verilog_tasks(spec: str) -> tuple[VerilogTask, ...]:
    """The tasks a source string names (see the module docstring)."""
    kind, _, path = spec.partition(":")
    if kind == "builtin":
        return builtin_tasks()
    if kind not in ("verilogeval", "rtllm", "jsonl") or not path:
        raise TaskSourceError(
            f"unknown verilog source {spec!r}: use builtin, verilogeval:DIR, rtllm:DIR or "
            "jsonl:FILE"
        )
    if not Path(path).exists():
        raise TaskSourceError(f"verilog source {spec!r}: {path} does not exist")
    if kind == "jsonl":
        tasks = read_verilog_jsonl(path)
    else:
        tasks = with_vectors(load_verilogeval(path) if kind == "verilogeval" else load_rtllm(path))
    if not tasks:
        raise TaskSourceError(f"verilog source {spec!r} has no usable task (see the warnings)")
    return tuple(tasks)


def open_verilog_source(spec: str, kind: str = "all") -> TaskList:
    """A `TaskList` of the source's tasks, filtered to combinational or sequential ones."""
    tasks = load_verilog_tasks(spec)
    if kind != "all":
        tasks = tuple(t for t in tasks if t.sequential == (kind == "sequential"))
        if not tasks:
            raise TaskSourceError(f"verilog source {spec!r} has no {kind} task")
    return TaskList(spec, tasks)
