"""Test harness: the program the code judge runs in the sandbox (stdlib only).

It reads one JSON request on stdin: the candidate `code`, `fn_name` (None for stdin
programs), `cases` (each an `input` and an output `cap` in bytes), a per-case `timeout` (CPU seconds,
with a wall-clock backstop) and `stop_on_error`. Each case runs in a fresh forked process with its own stdin, stdout and
stderr; the harness reports one JSON line per case on its stdout: `status` (ok, error,
timeout, memory, output_limit), `output` (what was printed, or the JSON of the return value)
and the tail of `stderr`. Expected outputs never enter this process: the parent compares.

With `oracle` set, the program is a hidden reference and the inputs are policy-written: each
case process runs under `OracleGuard`, which refuses to turn the input into code.
"""

# Loaded once here so every forked case starts with them imported.
import ast
import bisect  # noqa: F401
import builtins
import collections  # noqa: F401
import contextlib
import ctypes
import errno
import functools  # noqa: F401
import heapq  # noqa: F401
import itertools  # noqa: F401
import json
import math
import os
import re
import resource
import select
import signal
import sys
import threading
import time
import traceback
import typing  # noqa: F401

# What LeetCode-style solutions assume is in scope (List, deque, lru_cache, heappush, ...).
PREAMBLE = (
    "from typing import *\nfrom collections import *\nfrom heapq import *\n"
    "from bisect import *\nfrom itertools import *\nfrom functools import *\n"
    "import bisect, collections, functools, heapq, itertools, math, re, string\n"
)
EXIT_OK, EXIT_ERROR, EXIT_MEMORY, EXIT_OUTPUT = 0, 1, 3, 4
PR_SET_DUMPABLE = 4
ERR_TAIL = 2000


def jsonable(value):
    """json.dumps fallback: sets become sorted lists; anything else is an error."""
    if isinstance(value, set | frozenset):
        try:
            return sorted(value)
        except TypeError:
            return list(value)
    raise TypeError(f"the return value holds a {type(value).__name__}, which is not JSON")


def find_function(namespace, fn_name):
    fn = namespace.get(fn_name)
    if callable(fn) and not isinstance(fn, type):
        return fn
    solution = namespace.get("Solution")
    if isinstance(solution, type) and hasattr(solution, fn_name):
        return getattr(solution(), fn_name)
    raise NameError(f"no function {fn_name!r} (nor a Solution class with that method) defined")


def print_error() -> None:
    """The traceback from the candidate's own frames on (the harness's are noise to it)."""
    _, exc, tb = sys.exc_info()
    while tb is not None and tb.tb_frame.f_code.co_filename != "solution.py":
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)


def run_candidate(code, preamble, fn_name, args) -> int:
    """Inside the case process: run the program (or call the function) and exit."""
    try:
        if fn_name is None:
            namespace = {"__name__": "__main__", "__builtins__": builtins}
            with contextlib.suppress(SystemExit):  # how many contest programs end
                exec(code, namespace)
            threading._shutdown()  # join the program's non-daemon threads, as exit does
        else:
            namespace = {"__name__": "solution", "__builtins__": builtins}
            exec(preamble, namespace)
            exec(code, namespace)
            result = find_function(namespace, fn_name)(*args)
            data = json.dumps(result, default=jsonable, ensure_ascii=False).encode()
            view = memoryview(data)
            while view:
                view = view[os.write(3, view) :]
        sys.stdout.flush()
        return EXIT_OK
    except MemoryError:
        print_error()
        return EXIT_MEMORY
    except OSError as exc:
        if exc.errno == errno.EFBIG:  # RLIMIT_FSIZE: far more output than any test wants
            return EXIT_OUTPUT
        print_error()
        return EXIT_ERROR
    except BaseException:
        print_error()
        return EXIT_ERROR


# --- the oracle guard ------------------------------------------------------------------------
#
# A reference solution that evaluates its input (APPS-style `eval(input())`) would run a
# tester's input as code, in a process that holds the reference's source (the request, the
# code object, its frames). The guard makes sure no code from the input ever starts there:
# every text compiled at run time may only name what the reference's own text names (its
# identifiers and those of code in its strings), so data (`[1, 2]`, `3 + 4`) and the
# reference's own generated code run, while `__import__`, `gc`, frames, dunder attributes,
# `open` (unless the reference uses them) are refused before anything is executed. The other
# ways to make code out of data (marshal, code objects, pickle, a shell) are refused outright.

# Stdlib callers that compile only text they built from checked identifiers or parse without
# running: namedtuple, dataclasses, ast.parse (and so ast.literal_eval). Imports are trusted
# too (see `trusted`); a library that evaluates what it is given (sympify) is not.
TRUSTED_COMPILERS = ("ast", "collections", "dataclasses")
REFUSED = frozenset({"os.system", "os.exec", "os.spawn", "os.posix_spawn", "subprocess.Popen"})
REFUSED_FROM_CODE = frozenset({"marshal.loads", "code.__new__", "pickle.find_class"})
_NAME_FIELDS = ("id", "attr", "name", "asname", "arg", "module", "rest")
NAMELESS, NAMELESS_BYTES = re.compile(r"[^A-Za-z_]*"), re.compile(rb"[^A-Za-z_]*")
IMPORT_DEPTH = 256  # frames between a compile and the import it belongs to, at most
CODING = re.compile(rb"^[ \t\f]*#.*?coding[:=]", re.MULTILINE)  # PEP 263


class OracleRefusal(Exception):
    """Raised in the reference's process instead of running code made from its input."""


def names_in(tree, depth: int = 3) -> set:
    """Every identifier a syntax tree names, including in string constants that are code."""
    names = set()
    for node in ast.walk(tree):
        for field in _NAME_FIELDS:
            value = getattr(node, field, None)
            if isinstance(value, str):
                names.update(value.split("."))
        for field in ("names", "kwd_attrs"):  # Global, Nonlocal, MatchClass
            values = getattr(node, field, None)
            if isinstance(values, list):
                names.update(v for v in values if isinstance(v, str))
        if depth and isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
            with contextlib.suppress(SyntaxError, ValueError, RecursionError, MemoryError):
                names |= names_in(ast.parse(node.value), depth - 1)
    return names


class OracleGuard:
    """An audit hook (permanent once added) that keeps code made from input from starting."""

    def __init__(self, reference: str) -> None:
        self.allowed = names_in(ast.parse(reference))
        self.checking = set()  # threads inside a check: ast.parse raises `compile` itself

    def install(self) -> None:
        sys.addaudithook(self.hook)

    def hook(self, event, args) -> None:
        if event == "compile":
            source = args[0]  # `eval(str)` gives bytes
            nameless = NAMELESS_BYTES if isinstance(source, bytes) else NAMELESS
            if isinstance(source, str | bytes) and source.isascii() and nameless.fullmatch(source):
                return  # no identifier in it: literals and operators only (the common `eval`)
        elif event in REFUSED:
            raise OracleRefusal(f"the reference may not run {event} while judging an input")
        elif event not in REFUSED_FROM_CODE:
            return
        thread = threading.get_ident()
        if thread in self.checking:
            return
        self.checking.add(thread)
        try:
            try:
                caller = sys._getframe(1)
            except ValueError:  # raised from C with no Python frame above
                caller = None
            self.check(event, args, caller)
        finally:
            self.checking.discard(thread)

    def check(self, event, args, caller) -> None:
        if trusted(caller):
            return
        if event != "compile":
            raise OracleRefusal(f"the reference may not use {event} while judging an input")
        tree = parsed(args[0])
        unknown = names_in(tree, depth=0) - self.allowed
        if unknown:
            shown = ", ".join(sorted(unknown)[:5])
            raise OracleRefusal(
                f"the reference does not run code from its input (it names {shown}): a test "
                "input must be data"
            )


def parsed(source):
    """The syntax tree `compile` would build from `source`, or a refusal.

    Bytes are read as UTF-8 (what `eval(str)` passes on); a coding declaration, which bytes
    given to `compile` obey and text does not, is refused rather than guessed."""
    if isinstance(source, ast.AST):
        return source
    if isinstance(source, bytes):
        if CODING.search(b"\n".join(source.splitlines()[:2])):
            raise OracleRefusal("the text to evaluate declares its own encoding")
        try:
            source = source.decode("utf-8")
        except UnicodeDecodeError:
            raise SyntaxError("the text to evaluate is not UTF-8") from None
    try:
        try:
            return ast.parse(source)
        except SyntaxError:  # `eval` drops leading spaces and tabs, module code does not
            return ast.parse(source.lstrip(" \t"))
    except (SyntaxError, ValueError) as exc:  # compile would fail too: nothing runs
        raise SyntaxError(f"invalid syntax ({exc})") from None
    except (RecursionError, MemoryError):
        raise OracleRefusal("the text to evaluate is too deep to check") from None


def trusted(frame) -> bool:
    """True when `frame` is a stdlib module of TRUSTED_COMPILERS, or runs inside an import:
    a module's own code generating code as it loads (mpmath under sympy does)."""
    if frame is None:
        return False
    name = frame.f_globals.get("__name__")
    module = sys.modules.get(name) if name in TRUSTED_COMPILERS else None
    if module is not None and getattr(module, "__file__", None) == frame.f_code.co_filename:
        return True
    for _ in range(IMPORT_DEPTH):  # bounded: a deep recursion pays no more than this
        if frame is None:
            return False
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def memfile(name: str, data: bytes = b"") -> int:
    fd = os.memfd_create(name)
    if data:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    return fd


def wall_limit(timeout: float) -> float:
    """The wall-clock backstop for a case whose CPU limit is `timeout` (sleepers, blocked I/O).

    CPU time decides timeouts so that a loaded machine does not fail correct programs."""
    return 2 * timeout + 1


def wait_for(pid: int, timeout: float):
    """(wait status, CPU seconds) of the case process; status None when it was killed."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    wall = wall_limit(timeout)
    deadline = time.monotonic() + wall
    done = False
    if pidfd is not None:
        done = bool(select.select([pidfd], [], [], wall)[0])
        os.close(pidfd)
    else:
        while not done and time.monotonic() < deadline:
            done = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
            time.sleep(0.002)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # the case and anything it left in its process group
    _, status, usage = os.wait4(pid, 0)
    return (status if done else None), usage.ru_utime + usage.ru_stime


def tail(fd: int) -> str:
    size = os.fstat(fd).st_size
    data = os.pread(fd, ERR_TAIL, max(0, size - ERR_TAIL))
    return data.decode("utf-8", "replace")


def run_case(code, preamble, fn_name, case, timeout, guard=None) -> dict:
    """Run one case in a forked process; `timeout` is its CPU time limit in seconds; `guard`
    (an OracleGuard) is installed in that process before the program starts."""
    call_based = fn_name is not None
    stdin = b"" if call_based else str(case["input"]).encode("utf-8", "replace")
    in_fd, out_fd, err_fd = memfile("stdin", stdin), memfile("stdout"), memfile("stderr")
    res_fd = memfile("result") if call_based else None
    sys.stdout.flush()
    try:
        pid = os.fork()
    except OSError as exc:  # the process limit: nothing of the case could run
        return {"status": "error", "output": "", "stderr": f"could not start the test: {exc}"}
    if pid == 0:
        code_ = EXIT_ERROR
        try:
            os.setpgid(0, 0)
            _, hard = resource.getrlimit(resource.RLIMIT_CPU)
            soft = max(1, math.ceil(timeout))
            if hard != resource.RLIM_INFINITY:
                soft = min(soft, hard)
            resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))  # SIGXCPU: a timeout
            for target, fd in ((0, in_fd), (1, out_fd), (2, err_fd)):
                os.dup2(fd, target)
            if res_fd is not None:
                os.dup2(res_fd, 3)
            # The report pipe and the memfiles of other streams stay out of the program's reach.
            os.closerange(4 if call_based else 3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
            sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
            sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
            if guard is not None:
                guard.install()
            code_ = run_candidate(code, preamble, fn_name, case["input"])
            sys.stderr.flush()
        finally:
            os._exit(code_)
    status, cpu = wait_for(pid, timeout)
    cap = int(case["cap"])
    source_fd = res_fd if call_based else out_fd
    output = os.pread(source_fd, cap + 1, 0)
    result = {"stderr": tail(err_fd)}
    for fd in (in_fd, out_fd, err_fd, res_fd):
        if fd is not None:
            os.close(fd)
    if status is None or cpu > timeout:
        verdict = "timeout"
    elif os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        verdict = {signal.SIGXCPU: "timeout", signal.SIGXFSZ: "output_limit"}.get(sig, "error")
    else:
        code_ = os.WEXITSTATUS(status)
        verdict = {EXIT_OK: "ok", EXIT_MEMORY: "memory", EXIT_OUTPUT: "output_limit"}.get(
            code_, "error"
        )
    if verdict == "ok" and len(output) > cap:
        verdict = "output_limit"
    result.update(status=verdict, output=output[:cap].decode("utf-8", "replace"))
    return result


def main() -> None:
    # Not dumpable: a test process (same uid) cannot open /proc/<harness>/fd/1 or ptrace us
    # to forge the report.
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    request = json.loads(sys.stdin.buffer.read())
    fn_name = request.get("fn_name")
    report = os.fdopen(os.dup(1), "w", encoding="utf-8")
    try:
        code = compile(request["code"], "solution.py", "exec")
        preamble = compile(PREAMBLE, "preamble.py", "exec")
    except (SyntaxError, ValueError) as exc:
        message = "".join(traceback.format_exception_only(type(exc), exc))
        for i in range(len(request["cases"])):
            report.write(json.dumps({"i": i, "status": "error", "output": "", "stderr": message}))
            report.write("\n")
        report.flush()
        return
    guard = OracleGuard(request["code"]) if request.get("oracle") else None
    for i, case in enumerate(request["cases"]):
        result = run_case(code, preamble, fn_name, case, float(request["timeout"]), guard)
        report.write(json.dumps({"i": i, **result}, ensure_ascii=False) + "\n")
        report.flush()
        if request.get("stop_on_error") and result["status"] != "ok":
            break


if __name__ == "__main__":
    main()
