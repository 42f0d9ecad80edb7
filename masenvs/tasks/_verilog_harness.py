"""Compile and simulate Verilog with Icarus inside the sandbox (standard library only).

Run by `verilog_judge.py` as the sandbox program: it reads a JSON request on stdin, a list of
simulations (files, top module, one vvp run per stimulus sequence), and prints one JSON line
of results. The parent imports `check_design` from here too, so the rules that reject a
design before compiling are the same on both sides of the sandbox.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import subprocess
import sys
import time

# System tasks and functions a design may call: arithmetic, sizing, printing, ending the
# simulation. Anything else ($system, $fopen, $readmemh, $dumpfile, VPI calls) is rejected
# before compiling: it reads or writes host files or runs programs.
ALLOWED_SYSTEM_CALLS = frozenset(
    """
    $clog2 $signed $unsigned $bits $size $high $low $left $right $increment $dimensions
    $countones $onehot $onehot0 $isunknown $countbits
    $display $displayb $displayh $displayo $write $writeb $writeh $writeo $strobe $monitor
    $time $stime $realtime $finish $stop $error $warning $info $fatal
    $random $urandom $urandom_range $rtoi $itor $realtobits $bitstoreal $floor $ceil $sqrt
    $pow $ln $log10 $exp $abs $min $max
    """.split()  # noqa: SIM905
)
_SYSTEM_CALL = re.compile(r"\$[A-Za-z_][A-Za-z0-9_$]*")
_INCLUDE = re.compile(r"`\s*include\b\s*(\S*)")
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)


def check_design(text: str, include_files: tuple[str, ...] = ()) -> str | None:
    """Why `text` may not be compiled (one sentence), or None when it may.

    Comments count too: a design's text is rejected on what it says anywhere, so no trick of
    the preprocessor can revive a forbidden call hidden in a comment or a macro.
    """
    for match in _INCLUDE.finditer(text):
        arg = match.group(1)
        name = arg[1:-1] if len(arg) >= 2 and arg[0] == arg[-1] == '"' else None
        if name is None or name not in include_files:
            allowed = ", ".join(include_files) or "none"
            return (
                f"`include {arg[:80]} is outside the task directory: only the task's own files "
                f"may be included ({allowed})"
            )
    for match in _SYSTEM_CALL.finditer(text):
        if match.group(0) not in ALLOWED_SYSTEM_CALLS:
            return (
                f"{match.group(0)} is not allowed (it can reach the host): a design may use only "
                "arithmetic, sizing and printing system calls such as $clog2, $signed, $display"
            )
    return None


def _run(argv: list[str], timeout: float, max_output: int) -> tuple[str, str, bytes]:
    """Run `argv`; (status, stderr tail, stdout) with status ok, error, timeout, output_limit."""
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = bytearray(), bytearray()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    deadline = time.monotonic() + timeout
    status = None
    open_streams = 2
    while open_streams:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            status = "timeout"
            break
        for key, _ in sel.select(remaining):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            key.data.extend(chunk)
            if len(out) + len(err) > max_output:
                status = "output_limit"
                break
        if status:
            break
    if status:
        proc.kill()
    code = proc.wait()
    sel.close()
    proc.stdout.close()
    proc.stderr.close()
    if status is None:
        status = "ok" if code == 0 else "error"
    message = err.decode("utf-8", "replace")
    return status, message[-2000:], bytes(out[:max_output])


def simulate(sim: dict, timeout: float, max_output: int) -> dict:
    """One design: check, preprocess, check again, compile, then one vvp run per sequence."""
    workdir = sim["dir"]
    os.makedirs(workdir, exist_ok=True)
    for name, text in sim["files"].items():
        with open(os.path.join(workdir, name), "w", encoding="utf-8") as f:
            f.write(text)
    checked = sim.get("checked", [])
    includes = tuple(sim.get("includes", ()))
    for name in checked:
        problem = check_design(sim["files"][name], includes)
        if problem:
            return {"status": "forbidden", "message": problem}
    sources = [os.path.join(workdir, n) for n in sim["compile"]]
    start = time.monotonic()
    for name in checked:  # the preprocessed text too: macros cannot assemble a forbidden call
        pre = os.path.join(workdir, name + ".E")
        status, message, _ = _run(
            ["iverilog", "-g2012", "-E", "-I", workdir, "-o", pre, os.path.join(workdir, name)],
            timeout,
            max_output,
        )
        if status != "ok":
            return {"status": "compile_error" if status == "error" else status, "message": message}
        with open(pre, encoding="utf-8", errors="replace") as f:
            problem = check_design(f.read(), includes)
        if problem:
            return {"status": "forbidden", "message": problem}
    binary = os.path.join(workdir, "sim.vvp")
    argv = ["iverilog", "-g2012", "-I", workdir, "-s", sim["top"], "-o", binary, *sources]
    status, message, _ = _run(argv, timeout, max_output)
    if status != "ok":
        return {"status": "compile_error" if status == "error" else status, "message": message}
    outputs = []
    for plusargs in sim["runs"]:
        left = timeout - (time.monotonic() - start)
        status, message, out = _run(["vvp", "-n", binary, *plusargs], max(left, 0.1), max_output)
        if status != "ok":
            return {"status": status, "message": message, "outputs": outputs}
        text = out.decode("utf-8", "replace")
        marker = sim.get("marker")
        if marker:  # only the testbench's lines, which carry a marker the design cannot know
            text = "".join(ln for ln in text.splitlines(True) if ln.startswith(marker))
        outputs.append(text)
    return {"status": "ok", "message": message, "outputs": outputs}


def main() -> None:
    request = json.loads(sys.stdin.read())
    results = []
    for sim in request["sims"]:
        try:
            results.append(simulate(sim, request["timeout"], request["max_output"]))
        except OSError as exc:  # e.g. the private /tmp is full: this sim fails, not the rest
            results.append({"status": "error", "message": f"the simulation could not run: {exc}"})
        shutil.rmtree(sim["dir"], ignore_errors=True)
    sys.stdout.write(json.dumps(results))


if __name__ == "__main__":
    main()
