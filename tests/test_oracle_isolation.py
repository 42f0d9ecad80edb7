"""The oracle never runs policy input with its secrets in reach.

A code task's reference solution checks the tester's tests; a Verilog task's golden module
gives the outputs on the verifier's stimulus. Each is hidden data: a policy that reads one
can copy it. These tests attack through the env's public path, as a policy would.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import masenvs
from masenvs.sandbox import default_sandbox
from masenvs.tasks.code_judge import CodeJudge, Suite
from masenvs.tasks.code_problems import PROBLEMS
from masenvs.tasks.records import TestCase

# --- code: the reference evaluates its input (APPS-style `eval(input())`) ---------------------

SECRETS = ("k3y-alpha", "k3y-bravo")


def sum_task(secret: str, call_based: bool = False) -> dict[str, Any]:
    """Sum a list given as a Python literal; the reference carries `secret` in its source,
    as any reference carries the answer: two tasks that differ only there behave the same."""
    if call_based:
        reference = f"SALT = {secret!r}\n\ndef total(text):\n    return sum(eval(text))\n"
        return {
            "id": "sum-call",
            "prompt": "total(text): the sum of the Python list literal `text`.",
            "fn_name": "total",
            "tests": [{"input": [f"[{n}, {n}]"], "output": 2 * n} for n in (1, 2, 3)],
            "reference_solution": reference,
        }
    reference = f"SALT = {secret!r}\nprint(sum(eval(input())))\n"
    return {
        "id": "sum",
        "prompt": "Read a Python list literal of integers and print its sum.",
        "tests": [{"input": f"[{n}, {n}]\n", "output": f"{2 * n}\n"} for n in (1, 2, 3)],
        "public_tests": [{"input": "[4]\n", "output": "4\n"}],
        "reference_solution": reference,
    }


def probes(secret: str) -> list[str]:
    """Test inputs that, evaluated by the reference, give [1] when `secret` is in its source
    and [0] otherwise: through gc, the harness's request, the caller's constants, the code
    object the harness runs."""
    s = repr(secret)
    stack = "__import__('traceback').walk_stack(__import__('sys')._getframe())"
    return [
        f"[int(any({s} in o.get('code', '') for o in __import__('gc').get_objects() "
        "if type(o) is dict and type(o.get('code')) is str))]",
        f"[int(any({s} in str(f.f_locals.get('request', {{}}).get('code')) for f, _ in {stack}))]",
        f"[int({s} in __import__('sys')._getframe(1).f_code.co_consts)]",
        f"[int(any({s} in repr(getattr(f.f_locals.get('code'), 'co_consts', ())) "
        f"for f, _ in {stack}))]",
    ]


def written_tests(pairs: list[tuple[str, str]], call_based: bool) -> str:
    lang = "json" if call_based else ""
    return "".join(
        f"**Test Input:**\n```{lang}\n{i}\n```\n**Test Output:**\n```{lang}\n{o}\n```\n"
        for i, o in pairs
    )


def leak_episode(secret: str, call_based: bool) -> list[Any]:
    """A round where the tester probes the reference for SECRETS[0], then the coder's next
    prompt: everything a policy sees and is paid."""
    env = masenvs.make("code")
    env.reset(seed=0, options={"task": sum_task(secret, call_based)})
    inputs = probes(SECRETS[0])
    if call_based:
        pairs = [(json.dumps([p]), "1") for p in inputs]
        coder = "```python\ndef total(text):\n    return 1\n```"
    else:
        pairs = [(p, "1") for p in inputs]
        coder = "```python\nprint(1)\n```"
    _, rewards, _, _, infos = masenvs.play_round(
        env, {"coder": coder, "tester": written_tests(pairs, call_based)}
    )
    return [
        rewards,
        infos["tester"]["tester_validity"],
        env.observe("tester"),
        env.observe("coder"),
    ]


@pytest.mark.parametrize("call_based", [False, True], ids=["stdin", "call"])
def test_a_testers_input_cannot_read_the_reference_it_is_judged_by(call_based: bool) -> None:
    """Two references that differ only in a secret in their source must look the same to the
    policy, whatever the tester's inputs make an `eval`ing reference do."""
    seen = [leak_episode(secret, call_based) for secret in SECRETS]
    assert seen[0] == seen[1]
    assert seen[0][1] == 0.0  # no probe agrees with the reference: none of them ran


def test_the_oracle_still_evaluates_data_and_its_own_code() -> None:
    """Honest references keep working: `eval` of literals and arithmetic, code they build
    from their own text, `ast.literal_eval`, namedtuples and dataclasses, libraries that
    generate code as they load (mpmath under sympy)."""
    references = {
        "literal": "print(sum(eval(input())))",
        "wrapped": "print(eval('max(' + input() + ')') - max(eval(input())))",
        "arithmetic": "print(eval(input().replace(' ', '+')))",
        "own exec": "exec('a = list(map(int, input().split()))\\n' * 1)\nprint(sum(a))",
        "literal_eval": "import ast\nprint(sum(ast.literal_eval(input())))",
        "structures": (
            "from collections import namedtuple\nfrom dataclasses import dataclass\n"
            "P = namedtuple('P', input().split())\n@dataclass\nclass Q:\n    v: int\n"
            "print(sum(P(*map(int, input().split()))) + Q(0).v)"
        ),
        "libraries": (
            "import numpy as np\nfrom sympy import Rational\n"
            "print(Rational(int(np.array(eval(input())).sum()), 2))"
        ),
    }
    inputs = {
        "literal": ("[1, 2, 3]\n", "6"),
        "wrapped": ("4, 7\n[1]\n", "6"),
        "arithmetic": ("1 2 3\n", "6"),
        "own exec": ("1 2 3\n", "6"),
        "literal_eval": ("[1, 2, 3]\n", "6"),
        "structures": ("ab cd\n2 4\n", "6"),
        "libraries": ("[5, 7]\n", "6"),
    }
    suites = [
        Suite(code, (TestCase(*inputs[name]),), oracle=True) for name, code in references.items()
    ]
    results = CodeJudge(timeout=2).run_many(suites)
    statuses = {n: [c.status for c in r.cases] for n, r in zip(references, results)}
    assert statuses == {n: ["pass"] for n in references}


def test_code_from_the_input_is_refused_in_the_oracle_and_only_there() -> None:
    """The same program and input: as the oracle it refuses to run the input as code; as the
    coder's program (its own code, nothing hidden in reach) it runs it."""
    payload = "__import__('os').getpid() * 0 + 6"
    program = "print(eval(input()))"
    test = (TestCase(payload, "6"),)
    oracle, coder = CodeJudge(timeout=2).run_many(
        [Suite(program, test, oracle=True), Suite(program, test)]
    )
    assert [c.status for c in oracle.cases] == ["error"]
    assert "input" in oracle.cases[0].error
    assert [c.status for c in coder.cases] == ["pass"]


READER = "import sys\nSALT = 'k3y'\nprint(eval(sys.stdin.readline()))\n"


@pytest.mark.parametrize(
    "text",
    [
        "__import__('gc').get_objects()",
        "eval('__imp' + 'ort__(\"gc\")')",  # assembled from pieces, past a first check
        "eval(sys.stdin.readline())\n__import__('gc')",  # the next line, through its own names
        "sys.modules",
        "().__class__.__base__.__subclasses__()",
        "print.__self__",
        "(lambda: 0).__code__",
        "[f for f in ()]",
        "__ｉｍｐｏｒｔ__('gc')",  # NFKC: the names checked are the parser's
        "  sys.modules",  # eval drops leading blanks
    ],
)
def test_the_oracle_refuses_code_even_made_of_its_own_names(text: str) -> None:
    (result,) = CodeJudge(timeout=2).run_many(
        [Suite(READER, (TestCase(text + "\n", "0"),), oracle=True)]
    )
    assert result.cases[0].status == "error"
    assert "OracleRefusal" in result.cases[0].error


def _shell_pickle_marshal() -> list[tuple[str, str]]:
    import base64
    import marshal
    import pickle

    class Run:
        def __reduce__(self):  # noqa: ANN204
            return (print, ("ran",))

    code = compile("print('ran')", "x", "exec")
    return [
        ("import os\nos.system(input())", "echo ran"),
        (
            "import pickle, base64\npickle.loads(base64.b64decode(input()))",
            base64.b64encode(pickle.dumps(Run())).decode(),
        ),
        (
            "import marshal, base64\nexec(marshal.loads(base64.b64decode(input())))",
            base64.b64encode(marshal.dumps(code)).decode(),
        ),
        # Bytes obey a coding declaration, text does not: as UTF-8 this is one string
        # literal, as UTF-7 (+ACI- is a quote, +ACM- a hash) a call.
        (
            "import sys\nexec(sys.stdin.buffer.read())",
            "# coding: utf-7\n\"+ACI-,print('ran')+ACM-\"",
        ),
    ]


@pytest.mark.parametrize(
    ("reference", "text"), _shell_pickle_marshal(), ids=["shell", "pickle", "marshal", "utf-7"]
)
def test_the_oracle_makes_no_code_out_of_data_in_other_ways(reference: str, text: str) -> None:
    test = (TestCase(text + "\n", "ran"),)
    oracle, own = CodeJudge(timeout=2).run_many(
        [Suite(reference, test, oracle=True), Suite(reference, test)]
    )
    assert oracle.cases[0].status == "error" and "OracleRefusal" in oracle.cases[0].error
    assert own.cases[0].status == "pass"  # the same program, as a coder's, runs it


def test_every_builtin_reference_judges_its_own_tests_as_an_oracle() -> None:
    """Honest tests are data: under the guard every reference still passes them."""
    suites = [
        Suite(p.reference_solution, p.tests + p.public_tests, p.fn_name, oracle=True)
        for p in PROBLEMS
    ]
    results = CodeJudge().run_many(suites)
    failing = {p.id: [c.status for c in r.cases] for p, r in zip(PROBLEMS, results)}
    assert {k: v for k, v in failing.items() if set(v) != {"pass"}} == {}


class RecordingSandbox:
    """The default sandbox, recording what each batch of runs was given."""

    def __init__(self) -> None:
        self.inner = default_sandbox()
        self.batches: list[list[str]] = []

    def run_many(self, jobs, max_workers=None):  # noqa: ANN001, ANN201
        self.batches.append([job.source + job.stdin for job in jobs])
        return self.inner.run_many(jobs, max_workers=max_workers)

    def run(self, source, stdin="", *args, **kw):  # noqa: ANN001, ANN201
        self.batches.append([source + stdin])
        return self.inner.run(source, stdin, *args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_the_reference_never_runs_beside_a_program_whose_output_the_coder_reads() -> None:
    """Concurrent runs share CPU and memory pressure: the reference's run on the tester's
    inputs and the coder's run on those tests (whose output the coder reads) never overlap."""
    task = sum_task(SECRETS[0])
    env = masenvs.make("code")
    env.reset(seed=0, options={"task": task})
    spy = RecordingSandbox()
    env.judge.sandbox = spy
    coder = "```python\nprint(sum(eval(input())) + 1000)\n```"
    tests = written_tests([("[1, 2]", "3"), ("[5]", "5")], call_based=False)
    masenvs.play_round(env, {"coder": coder, "tester": tests})
    reference = json.dumps(task["reference_solution"])[1:-1]
    program = "sum(eval(input())) + 1000"
    mixed = [
        b
        for b in spy.batches
        if any(reference in job for job in b) and any(program in job for job in b)
    ]
    assert any(reference in job for b in spy.batches for job in b)  # the reference did run
    assert mixed == []
    assert "tests [" not in env.observe("tester")  # both tests agree with the reference


# --- Verilog: the golden module runs in its own run ---------------------------------------------

MODEL = """```python
class RefModel:
    def __init__(self):
        pass
    def step(self, inputs):
        return {"out": inputs["in"] ^ 1}
def stimulus():
    return [{"in": 0}, {"in": 1}]
```"""


def test_the_golden_module_is_never_in_a_run_with_the_design() -> None:
    """The verifier's stimulus is simulated on the golden and on the design: in two runs, the
    design's without the golden's source in its files or its request."""
    env = masenvs.make("verilog", kind="combinational")
    env.reset(seed=0, options={"task": _inverter()})
    spy = RecordingSandbox()
    env.judge.sandbox = spy
    design = (
        "```verilog\nmodule top_module(input in, output out);\nassign out = in;\nendmodule\n```"
    )
    _, _, _, _, infos = masenvs.play_round(env, {"designer": design, "verifier": MODEL})
    golden = json.dumps(env.task.golden)[1:-1]
    mine = "assign out = in;"
    assert any(golden in job for b in spy.batches for job in b)  # the golden did run
    assert [job for b in spy.batches for job in b if golden in job and mine in job] == []
    # the judge still compares both outside the runs: the designer sees its mismatch
    assert infos["verifier"]["verifier_agreement"] == 1.0
    assert "your model gives" in env.observe("verifier")
    assert "Your design against the verifier's model" in env.observe("designer")


def _inverter() -> dict[str, Any]:
    golden = "module top_module(input in, output out);\n  assign out = ~in;  // GOLDEN\nendmodule\n"
    return {
        "id": "inverter",
        "spec": "out is the inverse of in.",
        "module": "top_module",
        "ports": [["in", "input", 1], ["out", "output", 1]],
        "golden": golden,
        "vectors": [[0], [1]],
        "expected": [["1"], ["0"]],
        "examples": 1,
    }


def test_no_reference_of_an_rtllm_folder_becomes_a_file_a_design_can_include(tmp_path) -> None:
    """A folder with the golden twice (`.v` and `.sv`): neither is a task file."""
    from masenvs.tasks.verilog_loaders import load_verilog_tasks

    folder = tmp_path / "Logic" / "inv"
    folder.mkdir(parents=True)
    (folder / "design_description.txt").write_text("Module inv: out is the inverse of in.\n")
    golden = "module inv(input in, output out);\n  assign out = ~in;\nendmodule\n"
    (folder / "verified_inv.v").write_text(golden)
    (folder / "verified_inv.sv").write_text(golden)
    (folder / "defs.vh").write_text("`define WIDTH 1\n")
    (task,) = load_verilog_tasks(f"rtllm:{tmp_path}")
    assert set(task.files) == {"defs.vh"}


# --- Verilog: the verifier's code never holds the hidden vectors where its output is shown -----

SNOOP = """```python
import sys

class RefModel:
    def __init__(self):
        pass
    def step(self, inputs):
        return {"y": inputs["a"]}

def stimulus():
    # the hidden vectors, where the driver keeps them, as this round's stimulus
    for depth in range(1, 6):
        req = sys._getframe(depth).f_locals.get("req")
        if req and req["sequences"]:
            return [{"a": v[0]} for v in req["sequences"][0][1:]]
    return [{"a": 0}]
```"""


def _copy_task(hidden: list[int]) -> dict[str, Any]:
    return {
        "id": "copy",
        "spec": "y equals a.",
        "module": "top_module",
        "ports": [["a", "input", 8], ["y", "output", 8]],
        "golden": "module top_module(input [7:0] a, output [7:0] y);\n  assign y = a;\nendmodule\n",
        "vectors": [[v] for v in hidden],
        "expected": [[format(v, "08b")] for v in hidden],
        "examples": 1,
    }


LOUD = """```python
class RefModel:
    def step(self, inputs):
        if inputs["a"] != 1:  # past the example: say what it saw
            raise ValueError(f"saw {inputs['a']}")
        return {"y": 1}
```"""


@pytest.mark.parametrize("verifier", [SNOOP, LOUD], ids=["stimulus", "message"])
def test_the_verifiers_stimulus_and_feedback_never_depend_on_the_hidden_vectors(
    verifier: str,
) -> None:
    """Two tasks that differ only in hidden vectors past the examples look the same to both
    agents, whatever the verifier's code does with what its run holds."""
    design = "```verilog\nmodule top_module(input [7:0] a, output [7:0] y);\nassign y = 0;\nendmodule\n```"
    seen = []
    for hidden in ([1, 200, 77, 133], [1, 9, 10, 11]):
        env = masenvs.make("verilog")
        env.reset(seed=0, options={"task": _copy_task(hidden)})
        masenvs.play_round(env, {"designer": design, "verifier": verifier})
        seen.append((env.observe("verifier"), env.observe("designer"), env.state.stimulus))
    assert seen[0] == seen[1]
