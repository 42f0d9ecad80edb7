"""Sandbox speed: short programs per second, serially and in parallel, with the CPU a run
costs; optionally against another tree's sandbox (e.g. the commit before the allow-list)
and against a fresh bubblewrap + interpreter per run, on the same machine, in one run.

Run: python bench/sandbox.py [--runs 100] [--repeats 5] [--before /tmp/old-worktree]
     [--bwrap-per-run] [--channels]
The target (docs/sandbox.md): at least 50 short programs/s serially on 2 cores. Each tree
runs in its own process (its own `masenvs`); repeats alternate between trees, so load on a
shared machine hits both alike. Compare rows of one run, not across runs.

`--channels` measures the best covert channels we could build from one run to the next
(a sender run, then a receiver run, as a hidden-test run and the next visible run would be):
the timing of a read of a shared file (a page the sender loaded is fast; the host evicts the
files first, as memory pressure does to files nobody reads), and the timing of a lookup of
a missing name in a shared dir (the sender's lookup leaves a negative dentry). Each message
starts with a known preamble that the receiver calibrates on; the rate is
bits x (1 - H(bit error rate)) / the seconds of both runs. A third, between two concurrent
runs: the sender busy-loops in the 20 ms slots of its 1 bits, the receiver counts its own
loop's turns in each slot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
SHORT_PROGRAM = "print(sum(range(1000)))"
EXPECTED = "499500\n"

# Runs in a child process whose PYTHONPATH starts with the tree under test.
WORKER = r"""
import json, os, resource, sys, time
from masenvs.sandbox import Sandbox, SandboxLimits
runs, mode = int(sys.argv[1]), sys.argv[2]
sandbox = Sandbox(SandboxLimits())
sandbox.run("print(1)")  # start the server outside the timing
def cpu():  # ours and every reaped descendant's (server, supervisors, programs)
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
start, cpu0 = time.perf_counter(), cpu()
if mode == "serial":
    outs = [sandbox.run(SHORT).stdout for _ in range(runs)]
else:
    outs = [r.stdout for r in sandbox.run_many([(SHORT, "")] * runs, 4)]
wall = time.perf_counter() - start
iso = sandbox.isolation
sandbox.close()  # reaps the server: its CPU counts in RUSAGE_CHILDREN
print(json.dumps({"rate": runs / wall, "cpu_ms": 1000 * (cpu() - cpu0) / runs,
                  "ok": outs == [EXPECTED] * runs, "mode": iso.mode,
                  "allow_list": getattr(iso, "allow_list", False)}))
"""


def measure(tree: Path, runs: int, mode: str) -> dict:
    """One timing of `runs` short programs with the sandbox of `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    script = f"SHORT = {SHORT_PROGRAM!r}\nEXPECTED = {EXPECTED!r}\n{WORKER}"
    out = subprocess.run(
        [sys.executable, "-c", script, str(runs), mode],
        capture_output=True,
        text=True,
        env=env,
        cwd=tree,
        timeout=600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the bench of {tree} failed: {out.stderr[-2000:]}")
    result = json.loads(out.stdout.splitlines()[-1])
    if not result["ok"]:
        raise RuntimeError(f"{tree}: a run printed something else than {EXPECTED!r}")
    return result


# Runs in a child process whose PYTHONPATH starts with the tree under test: sender and
# receiver runs, one after the other, for each channel; prints their bit errors and times.
CHANNEL_WORKER = r"""
import json, math, os, random, sys, sysconfig, time
from pathlib import Path
from masenvs.sandbox import Job, Sandbox, SandboxLimits
pairs, nbits = int(sys.argv[1]), int(sys.argv[2])
stdlib = Path(sysconfig.get_paths()["stdlib"])
skip = {"test", "site-packages", "__pycache__", "lib-dynload"}
files = [p for p in stdlib.rglob("*") if p.is_file() and not skip & set(p.parts)
         and p.suffix != ".so" and p.stat().st_size > 4 * 4096 and "config-" not in str(p)]
CHUNK = 2 * 4096  # a one-byte read at a random offset of a new open file loads its page
slots = [(str(f), k * CHUNK) for f in files for k in range(1, f.stat().st_size // CHUNK)]
PRE = "01" * 16
SEND_READ = '''
import os, sys, json
for (f, off), b in zip(json.loads(sys.argv[1]), sys.argv[2]):
    if b == "1":
        fd = os.open(f, os.O_RDONLY); os.pread(fd, 1, off); os.close(fd)
'''
RECV_READ = '''
import os, sys, json, time
ts = []
for f, off in json.loads(sys.argv[1]):
    fd = os.open(f, os.O_RDONLY)
    t = time.perf_counter_ns(); os.pread(fd, 1, off); ts.append(time.perf_counter_ns() - t)
    os.close(fd)
print(json.dumps(ts))
'''
SEND_NAME = '''
import os, sys, json
for p, b in zip(json.loads(sys.argv[1]), sys.argv[2]):
    if b == "1":
        os.path.exists(p)
'''
RECV_NAME = '''
import os, sys, json, time
ts = []
for p in json.loads(sys.argv[1]):
    t = time.perf_counter_ns(); os.path.exists(p); ts.append(time.perf_counter_ns() - t)
print(json.dumps(ts))
'''
def evict(slots):
    for f in {f for f, _ in slots}:
        fd = os.open(f, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
def decode(ts):
    # Calibrate on the warm half of the preamble (its first reads pay for warming up code).
    lt = [math.log(max(t, 1)) for t in ts]
    zero = sorted(lt[i] for i in range(len(PRE) // 2, len(PRE), 2))
    one = sorted(lt[i] for i in range(len(PRE) // 2 + 1, len(PRE), 2))
    z, o = zero[len(zero) // 2], one[len(one) // 2]
    return "".join("1" if abs(t - o) < abs(t - z) else "0" for t in lt)
sandbox = Sandbox(SandboxLimits(wall_seconds=20, cpu_seconds=20))
sandbox.run("print(1)")
out = {}
SEND_CPU = '''
import sys, time
start, SLOT = float(sys.argv[1]), 0.02
while time.time() < start:
    time.sleep(0.001)
for i, b in enumerate(sys.argv[2]):
    end = start + (i + 1) * SLOT
    if b == "1":
        while time.time() < end:
            pass
    else:
        time.sleep(max(0.0, end - time.time()))
'''
RECV_CPU = '''
import json, sys, time
start, SLOT = float(sys.argv[1]), 0.02
while time.time() < start:
    time.sleep(0.001)
counts = []
for i in range(int(sys.argv[2])):
    end, c = start + (i + 1) * SLOT, 0
    while time.time() < end:
        c += 1
    counts.append(c)
print(json.dumps(counts))
'''
for name in ("read timing", "lookup timing", "CPU contention (concurrent)"):
    errors = bits = 0
    seconds = 0.0
    size = nbits if "timing" in name else nbits // 4  # 20 ms a bit
    for pair in range(pairs):
        message = PRE + "".join(random.choice("01") for _ in range(size))
        start = time.perf_counter()
        if name == "CPU contention (concurrent)":  # both at once, slots of wall-clock time
            at = str(time.time() + 1.0)
            s, r = sandbox.run_many([Job(SEND_CPU, args=[at, message]),
                                     Job(RECV_CPU, args=[at, str(len(message))])], 2)
            seconds += time.perf_counter() - start - 1.0
        else:
            if name == "read timing":
                where = random.sample(slots, len(message))
                evict(where)
                send, recv = SEND_READ, RECV_READ
            else:
                tag = f"{os.getpid()}-{pair}-{random.getrandbits(48):x}"
                where = [str(stdlib / f".masenvs-channel-{tag}-{i}") for i in range(len(message))]
                send, recv = SEND_NAME, RECV_NAME
            s = sandbox.run(send, args=[json.dumps(where), message])
            r = sandbox.run(recv, args=[json.dumps(where)])
            seconds += time.perf_counter() - start
        if not (s.ok and r.ok):
            raise SystemExit(f"{name}: {s.stderr[-300:]} {r.stderr[-300:]}")
        got = decode(json.loads(r.stdout))
        errors += sum(a != b for a, b in zip(got[len(PRE):], message[len(PRE):]))
        bits += size
    p = errors / bits
    h = 0.0 if p in (0.0, 1.0) else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
    out[name] = {"error": p, "bits_per_s": bits * (1 - h) / seconds, "bits_per_pair": size * (1 - h)}
sandbox.close()
print(json.dumps(out))
"""


def channels(tree: Path, pairs: int, nbits: int) -> dict:
    """Bit error rate and capacity of each covert channel between two runs of `tree`."""
    out = subprocess.run(
        [sys.executable, "-c", CHANNEL_WORKER, str(pairs), str(nbits)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tree)},
        cwd=tree,
        timeout=900,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the channel bench of {tree} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def bwrap_per_run(runs: int) -> float:
    """Runs/s of a fresh bubblewrap root (the same allow-list) and interpreter per program."""
    from masenvs.sandbox.staging import bwrap_command

    command, _ = bwrap_command((), (), (), [])
    bwrap_args = command[: command.index("--") + 1]
    start = time.perf_counter()
    for _ in range(runs):
        out = subprocess.run(
            [*bwrap_args, sys.executable, "-I", "-c", SHORT_PROGRAM],
            capture_output=True,
            text=True,
            env={"PATH": "/usr/bin:/bin"},
        )
        if out.stdout != EXPECTED:
            raise RuntimeError(f"bwrap per run failed: {out.stderr[-500:]}")
    return runs / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--before", type=Path, help="another tree to compare (a git worktree)")
    parser.add_argument("--bwrap-per-run", action="store_true", help="also time bwrap per run")
    parser.add_argument("--channels", action="store_true", help="covert channels between runs")
    parser.add_argument("--pairs", type=int, default=20, help="--channels: sender/receiver pairs")
    parser.add_argument("--bits", type=int, default=256, help="--channels: bits per message")
    args = parser.parse_args()
    trees = {"this tree": ROOT}
    if args.before:
        trees = {"before": args.before.resolve(), **trees}
    console = Console()
    if args.channels:
        table = Table(title=f"covert channels between runs: {args.pairs} x {args.bits} bits")
        for column in ("tree", "channel", "bit errors", "bits/pair", "bits/s"):
            table.add_column(column, justify="left" if column in ("tree", "channel") else "right")
        for name, tree in trees.items():
            for channel, row in channels(tree, args.pairs, args.bits).items():
                table.add_row(
                    name,
                    channel,
                    f"{row['error']:.1%}",
                    f"{row['bits_per_pair']:.1f}",
                    f"{row['bits_per_s']:.1f}",
                )
        console.print(table)
        return
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeats):
        for mode in ("serial", "parallel"):
            for name, tree in trees.items():
                results.setdefault((name, mode), []).append(measure(tree, args.runs, mode))
    table = Table(title=f"sandbox: {SHORT_PROGRAM!r}, median of {args.repeats} x {args.runs} runs")
    for column in ("tree", "mode", "isolation", "runs/s", "CPU ms/run"):
        table.add_column(column, justify="right" if "/" in column else "left")
    for (name, mode), rows in results.items():
        iso = f"{rows[0]['mode']}{', allow-list' if rows[0]['allow_list'] else ''}"
        rate = statistics.median(r["rate"] for r in rows)
        cpu = statistics.median(r["cpu_ms"] for r in rows)
        table.add_row(name, mode, iso, f"{rate:.0f}", f"{cpu:.1f}")
    if args.bwrap_per_run:
        table.add_row("bwrap + python per run", "serial", "", f"{bwrap_per_run(args.runs):.0f}", "")
    console.print(table)
    with open("/proc/loadavg") as f:
        console.print(f"load average: {f.read().split()[:3]}, cpus: {os.cpu_count()}")


if __name__ == "__main__":
    main()
