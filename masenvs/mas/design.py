"""Run a designed multi-agent system: its code in the sandbox, its LLM calls through a gate.

The designer's action is Python (in `<code>` tags or a ```python block) that builds a block
named `system` from `masenvs.mas` (or defines `async def solve(messages) -> str`). Each
execution runs it in a fresh sandbox process with no network; the only way out is the
Unix socket of a `Gate` that records its calls under the execution's rollout id. What comes
back is a `DesignRun`: the answer, the executed graph, or the cause of the failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from masenvs.mas.llm import EXECUTOR, Message
from masenvs.parsing import last_code_block

RESULT_MARKER = "@@masenvs-design-result@@ "
MAX_ANSWER_CHARS = 20_000
# Imported once by the design sandbox's zygote: a design run needs nothing else.
PRELOAD = (
    "asyncio",
    "masenvs.mas._preload",
    "masenvs.mas.compat.workflow",  # the published `workflow` API (masenvs/mas/compat)
    "masenvs.mas.compat.utils.environments",
)

_RUNNER = "from masenvs.mas.design import _run_isolated\n_run_isolated()\n"
MAX_RESULT_BYTES = 4 << 20  # what the harness reads of a design's result


def extract_design(text: str) -> str | None:
    """The design's code: the last non-empty `<code>...</code>` block (unclosed: to the end,
    a ```python fence inside it unwrapped), else the last ```python block.

    Found with `rfind`/`find`, never a lazy regex: model output is adversarial input."""
    end = len(text)
    while (start := text.rfind("<code>", 0, end)) >= 0:
        close = text.find("</code>", start)
        body = text[start + 6 : close if close >= 0 else len(text)]
        code = (last_code_block(body) or body).strip()
        if code:
            return code
        end = start
    code = (last_code_block(text) or "").strip()
    return code or None


@dataclass
class DesignRun:
    """One execution of a design."""

    answer: str | None = None  # the system's final text
    graph: dict[str, Any] | None = None  # DesignGraph.to_dict() of the executed system
    error: str | None = None  # why it failed: "syntax error: ...", "timeout", ...
    calls: int = 0  # LLM calls the gate forwarded
    seconds: float = 0.0
    refused: list[str] = field(default_factory=list)  # requests the gate refused

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class DesignRunner:
    """Runs designs against the capture endpoint at `endpoint_url` (its root URL)."""

    endpoint_url: str | None
    models: dict[str, str] = field(default_factory=lambda: {EXECUTOR: EXECUTOR})
    api_key: str | None = None
    max_calls: int = 32  # per execution; more is refused (429) and fails the design
    max_tokens: int | None = None
    temperature: float | None = None
    seconds: float = 120.0  # wall time of one execution
    memory_mb: int = 1024
    max_tool_runs: int = 16  # runs of the Python tool (ToolAgent) per execution
    task: str = "math"  # math | code: what the `workflow` API's nodes are told to deliver
    repetition_penalty: float | None = None  # every call's (None: the endpoint's default)
    # "published": run it as the published harness would (masenvs.mas.compat.published):
    # a `workflow` script, patched as there, its nodes prompted as there
    harness: str = "masenvs"

    def run(self, source: str, messages: list[Message], rollout_id: str) -> DesignRun:
        from masenvs.mas.gate import Gate
        from masenvs.sandbox import Verdict

        if self.endpoint_url is None:
            return DesignRun(error="no endpoint to call: set the env's endpoint_url")
        started = time.monotonic()
        sandbox = design_sandbox()
        sandbox.check_judging("run designs whose answers are rewarded")
        gate = Gate(
            self.endpoint_url,
            rollout_id,
            self.models,
            max_calls=self.max_calls,
            api_key=self.api_key,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            max_tool_runs=self.max_tool_runs,
            repetition_penalty=self.repetition_penalty,
        )
        try:
            job = {
                "source": source,
                "messages": messages,
                "socket": sandbox.bind_path("gate.sock", gate.path),
                "model": next(iter(self.models)),
                "max_calls": self.max_calls,
                "max_tokens": self.max_tokens,
                "temperature": self.temperature,
                "task_type": self.task,
                "harness": self.harness,
            }
            limits = replace(
                sandbox.limits,
                wall_seconds=self.seconds,
                cpu_seconds=self.seconds,
                memory_mb=self.memory_mb,
            )
            # The run sees its own gate's socket and no other: a concurrent execution's
            # gate is not in its files, and abstract sockets stay in its network namespace.
            result = sandbox.run(
                _RUNNER, stdin=json.dumps(job), limits=limits, binds={"gate.sock": gate.path}
            )
        finally:
            gate.close()
        run = DesignRun(calls=gate.calls, seconds=time.monotonic() - started, refused=gate.refused)
        report = _report(result.stdout)
        if result.verdict == Verdict.TIMEOUT:
            run.error = f"timeout: the design ran past {self.seconds:g} s"
        elif result.verdict == Verdict.MEMORY:
            run.error = f"memory: the design went over {self.memory_mb} MB"
        elif result.verdict == Verdict.OUTPUT_LIMIT:
            run.error = "output limit: the design printed too much"
        elif report is None:
            tail = result.stderr.strip().splitlines()[-1:] or [f"exit code {result.returncode}"]
            run.error = f"crashed: {tail[0][:300]}"
        else:
            run.answer, run.graph, run.error = (
                report.get("answer"),
                _checked_graph(report.get("graph"), gate.call_ids),
                report.get("error"),
            )
            if run.error is None and not (run.answer or "").strip():
                run.error = "no answer: the system returned empty text"
        return run


_sandbox = None
_sandbox_lock = threading.Lock()


def design_sandbox() -> Any:
    """The sandbox designs run in (shared, started once, openai and masenvs.mas preloaded)."""
    global _sandbox
    from masenvs.mas.gate import GATE_DIR
    from masenvs.sandbox import DEFAULT_PRELOAD, Sandbox, SandboxLimits

    with _sandbox_lock:
        if _sandbox is None:
            limits = SandboxLimits(
                cpu_seconds=120, wall_seconds=120, memory_mb=1024, max_output_bytes=256 << 10
            )
            # Each run is given its own gate's socket out of GATE_DIR, and sees no other.
            GATE_DIR.mkdir(parents=True, exist_ok=True)
            _sandbox = Sandbox(
                limits, preload=(*DEFAULT_PRELOAD, *PRELOAD), bind_dirs=(str(GATE_DIR),)
            )
        return _sandbox


def _checked_graph(graph: Any, call_ids: list[tuple[str, str]]) -> dict[str, Any] | None:
    """The design's graph as its process described it (structure, nodes, edges), each node's
    calls taken from the gate's record of the calls it forwarded for `executor@<node>`, never
    from the design's report, which the design could forge."""
    from masenvs.mas.llm import node_tag

    if not isinstance(graph, dict) or not isinstance(graph.get("nodes"), list):
        return None
    nodes = [
        {**n, "calls": [cid for tag, cid in call_ids if tag == node_tag(n["name"])]}
        for n in graph["nodes"]
        if isinstance(n, dict) and isinstance(n.get("name"), str)
    ]
    return {**graph, "nodes": nodes}


def _report(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            try:
                return json.loads(line[len(RESULT_MARKER) :])
            except ValueError:
                return None
    return None


# --- inside the sandbox ----------------------------------------------------------------------

_RESULT_FD: int | None = None  # set in the design's process: the pipe to the harness


def _deliver(out: dict[str, Any]) -> None:
    """Hand the result to the harness (or print it, when `_main` runs on its own)."""
    data = json.dumps(out).encode()
    if _RESULT_FD is None:
        print(RESULT_MARKER + data.decode(), flush=True)
        return
    view = memoryview(data)
    while view:
        view = view[os.write(_RESULT_FD, view) :]


def _run_isolated() -> None:
    """The sandbox program: run the design in a child process, print the result line.

    Only this process holds the sandbox's stdout. The design's code runs in a child whose
    stdout and stderr both go to the sandbox's stderr, and its result comes back over a
    pipe, so nothing the design prints can pass for the result. This process is not
    dumpable: the child (same uid) can neither ptrace it nor open its descriptors in /proc."""
    import ctypes
    import io
    import select

    global _RESULT_FD
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
    job_text = sys.stdin.read()
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.dup2(2, 1)  # the sandbox's stdout is the harness's alone
            sys.stdin = io.StringIO(job_text)
            _RESULT_FD = w
            _main()
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    os.close(w)
    # Read until the child exits (not until EOF: something it started may hold the pipe).
    pidfd = os.pidfd_open(pid)
    data = bytearray()
    watched = [r, pidfd]
    while pidfd in watched:
        for fd in select.select(watched, [], [])[0]:
            if fd == pidfd:
                watched.remove(pidfd)
            elif chunk := os.read(r, 65536):
                data += chunk[: max(0, MAX_RESULT_BYTES - len(data))]
            else:
                watched.remove(r)
    os.set_blocking(r, False)
    with contextlib.suppress(BlockingIOError):
        while len(data) < MAX_RESULT_BYTES and (chunk := os.read(r, 65536)):
            data += chunk
    os.waitpid(pid, 0)
    try:
        out = json.loads(data)
    except ValueError:
        return  # the design's process died first: the runner reports it from stderr
    if isinstance(out, dict):
        print(RESULT_MARKER + json.dumps(_result_fields(out)), flush=True)


def _result_fields(out: dict[str, Any]) -> dict[str, Any]:
    """Only the result's fields, each of its type (the design's process wrote them)."""
    answer, graph, error = out.get("answer"), out.get("graph"), out.get("error")
    return {
        "answer": answer[:MAX_ANSWER_CHARS] if isinstance(answer, str) else None,
        "graph": graph if isinstance(graph, dict) else None,
        "error": error[:2000] if isinstance(error, str) else None,
    }


def _as_run(source: str, published: bool) -> str:
    """The design's code as its harness runs it: the published one patches it first."""
    if not published:
        return source
    from masenvs.mas.compat.published import patch_script

    return patch_script(source)


def _main() -> None:
    """Run one design (stdin: the job as JSON) and print the result line."""
    import asyncio
    import inspect

    from masenvs.mas.blocks import Block
    from masenvs.mas.graph import DesignGraph, Node
    from masenvs.mas.llm import BudgetExceeded, connect, use

    job = json.loads(sys.stdin.read())
    out: dict[str, Any] = {"answer": None, "graph": None, "error": None}
    published = job.get("harness") == "published"
    llm = connect(
        uds=job["socket"],
        model=job["model"],
        max_calls=job["max_calls"],
        max_tokens=job["max_tokens"],
        temperature=job["temperature"],
        per_node=True,
        harness=job.get("harness") or "masenvs",
    )
    system: Any = None
    source = _as_run(job["source"], published)
    try:
        code = compile(source, "<design>", "exec")
    except SyntaxError as exc:
        out["error"] = f"syntax error: {exc.msg} (line {exc.lineno})"
    else:
        from masenvs.mas import compat

        # The published harness runs every design as a `workflow` script; ours also runs
        # masenvs blocks.
        if published or compat.uses_workflow_api(source):
            question = next(
                (m["content"] for m in reversed(job["messages"]) if m["role"] == "user"), ""
            )
            out = compat.run_script(code, llm, job.get("task_type"), question)
            out["answer"] = out["answer"] and out["answer"][:MAX_ANSWER_CHARS]
        else:
            import masenvs.mas as library

            # The blocks come imported, as the designer's prompt says.
            namespace: dict[str, Any] = {"__name__": "__design__"}
            namespace.update({name: getattr(library, name) for name in library.__all__})
            try:
                with use(llm):
                    exec(code, namespace)
                    system = namespace.get("system") or namespace.get("solve")
                    if system is None or not callable(system):
                        raise LookupError(
                            "the design defines no `system` block (or `async def solve(messages)`)"
                        )

                    async def go() -> Any:
                        try:
                            result = system(job["messages"])
                            return await result if inspect.isawaitable(result) else result
                        finally:
                            await llm.aclose()

                    answer = asyncio.run(go())
                if not isinstance(answer, str):
                    raise TypeError(f"the system returned {type(answer).__name__}, not text")
                out["answer"] = answer[:MAX_ANSWER_CHARS]
            except BudgetExceeded as exc:
                out["error"] = f"budget: {exc}"
            except BaseException as exc:  # the design's own failure, reported, never raised
                out["error"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
    calls = llm.calls_by_node()
    if out["graph"] is not None:
        pass  # a workflow script's graph, from the run
    elif isinstance(system, Block):
        out["graph"] = DesignGraph.of(system, calls).to_dict()
    elif calls:
        out["graph"] = DesignGraph(
            "solve()", [Node(n, "", ids) for n, ids in calls.items()], []
        ).to_dict()
    sys.stdout.flush()
    _deliver(out)
