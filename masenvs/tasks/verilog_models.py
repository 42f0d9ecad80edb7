"""A verifier's Python reference model and stimulus, run in the sandbox: the request, the
driver appended to the verifier's code (a fresh `RefModel` per sequence, then its own
`stimulus()`), and the run read back as a `ModelRun`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from masenvs.sandbox import RunResult, Verdict

Vector = tuple[int, ...]  # one value per stimulus input (every input but the clock)
Outputs = tuple[str, ...]  # one `%b` string per output port

MAX_STIMULUS = 64  # vectors of a verifier's stimulus that count


@dataclass
class ModelRun:
    """A verifier's Python reference model and stimulus, as run in the sandbox."""

    status: str  # "ok", "error", "timeout", "memory", "output_limit"
    message: str = ""
    outputs: list[list[Outputs]] = field(default_factory=list)  # per requested sequence
    stimulus: tuple[Vector, ...] = ()
    stimulus_outputs: list[Outputs] = field(default_factory=list)


def to_bits(value: int, width: int) -> str:
    return format(value & ((1 << width) - 1), f"0{width}b")


def model_request(
    inputs: Sequence[tuple[str, int]],
    outputs: Sequence[tuple[str, int]],
    sequences: Sequence[Sequence[Vector]],
    stimulus: bool,
) -> str:
    """The driver's stdin: the (name, width) ports, the sequences to run and whether to ask
    for the verifier's stimulus."""
    request = {
        "inputs": [list(p) for p in inputs],
        "outputs": [list(p) for p in outputs],
        "sequences": [[list(v) for v in s] for s in sequences],
        "max_stimulus": MAX_STIMULUS,
        "stimulus": stimulus,
    }
    return json.dumps(request)


def read_model_run(run: RunResult, widths: Sequence[int], n_sequences: int) -> ModelRun:
    """The model's outputs (ports of `widths`) per requested sequence and on its own
    stimulus, as `%b` text; a run that failed is a `ModelRun` with its status and last error
    line."""
    found = run.stdout.rfind(MODEL_MARK)
    if run.verdict != Verdict.OK or found < 0:
        status = str(run.verdict) if run.verdict != Verdict.OK else "error"
        lines = run.stderr.strip().splitlines()
        return ModelRun(status, lines[-1][:500] if lines else "it printed no result")
    data = json.loads(run.stdout[found + len(MODEL_MARK) :])
    if "error" in data:
        return ModelRun("error", data["error"][:500])
    outputs = [
        [tuple(to_bits(v, w) for v, w in zip(row, widths)) for row in seq]
        for seq in data["outputs"]
    ]
    stimulus = tuple(tuple(v) for v in data["stimulus"])
    return ModelRun("ok", "", outputs[:n_sequences], stimulus, outputs[n_sequences])


MODEL_MARK = "\n@@masenvs-model@@"
# Appended to the verifier's code: the model on each sequence (a fresh RefModel per
# sequence), then on the verifier's own stimulus; values as ints in one JSON line.
MODEL_DRIVER = """

def _masenvs_main():
    import json as _json
    import sys as _sys
    req = _json.loads(_sys.stdin.read())
    ins = [n for n, _ in req["inputs"]]
    outs = [n for n, _ in req["outputs"]]

    def fail(text):
        _sys.stdout.write(MARK + _json.dumps({"error": text}) + "\\n")
        _sys.exit(0)

    if "RefModel" not in globals():
        fail("no class RefModel defined")
    stim = []
    if req["stimulus"] and "stimulus" in globals():
        raw = stimulus()
        if not isinstance(raw, (list, tuple)):
            fail("stimulus() must return a list of dicts of input values")
        for vec in list(raw)[: req["max_stimulus"]]:
            if not isinstance(vec, dict):
                fail("stimulus() must return a list of dicts of input values")
            unknown = [k for k in vec if k not in ins]
            if unknown:
                fail(f"stimulus() names unknown inputs {unknown}; inputs are {ins}")
            try:
                stim.append([int(vec.get(n, 0)) & ((1 << w) - 1) for n, w in req["inputs"]])
            except (TypeError, ValueError):
                fail("stimulus() values must be integers")
    results = []
    for seq in req["sequences"] + [stim]:
        model = RefModel()
        rows = []
        for vec in seq:
            got = model.step(dict(zip(ins, vec)))
            if not isinstance(got, dict):
                fail(f"RefModel.step must return a dict of outputs, got {type(got).__name__}")
            missing = [n for n in outs if n not in got]
            if missing:
                fail(f"RefModel.step returned no value for {missing}")
            try:
                rows.append([int(got[n]) for n in outs])
            except (TypeError, ValueError):
                fail("RefModel.step must return integer output values")
        results.append(rows)
    _sys.stdout.write(MARK + _json.dumps({"outputs": results, "stimulus": stim}) + "\\n")


_masenvs_main()
""".replace("MARK", repr(MODEL_MARK))
