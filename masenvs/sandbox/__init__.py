"""Run model-written Python in a child process with limits, isolation and explicit verdicts.

The package front door: `Sandbox`, its limits and results. One file per process or job:
- client.py: the `Sandbox` API in the parent, which starts the server and asks for runs;
- layout.py: the allow-list root (bubblewrap arguments) and its copy in RAM;
- staging.py: the server's staged copy and the bubblewrap command that boots it;
- supervisor.py: the zygote server and the supervisor it forks per run;
- runsetup.py, seccomp.py: namespaces, mounts, capabilities and the seccomp filter;
- cgroup.py: the memory cgroup of each run; pagecache.py: the pinner, which locks what runs
  read in memory and finds task data they could read;
- program.py: a run's namespace init and the program itself;
- limits.py: `SandboxLimits`, verdicts and the rlimits behind them; wire.py: the messages.
The server runs a staged copy of this package's modules with the standard library only (see
docs/sandbox.md for the threat model).
"""

# The server's own modules are imported too (nothing here uses them): a staged copy of
# masenvs.sandbox (staging.masenvs_modules follows imports) then holds all of them.
from . import program, supervisor
from .client import (
    DEFAULT_PACKAGES,
    DEFAULT_PRELOAD,
    SERVER_GRACE_SECONDS,
    WEAK_SANDBOX_OPT_IN,
    Isolation,
    Job,
    RunResult,
    Sandbox,
    SandboxError,
    default_sandbox,
)
from .limits import CHILD_ENV, UID_BASE, UID_SLOTS, SandboxLimits, Verdict
from .runsetup import (
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    CLONE_NEWUTS,
    M_ARENA_MAX,
    MS_BIND,
    MS_NOATIME,
    MS_NODEV,
    MS_NODIRATIME,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_RELATIME,
    MS_REMOUNT,
    MS_STRICTATIME,
    PR_CAPBSET_DROP,
    PR_SET_CHILD_SUBREAPER,
    PR_SET_NO_NEW_PRIVS,
    PR_SET_PDEATHSIG,
)
from .seccomp import F_GETLK, F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW, F_SETLK, F_SETLKW
from .wire import BIND_DIRS_MOUNT, MAX_BINDS, RUN_BIND_DIR

__all__ = [
    "BIND_DIRS_MOUNT",
    "CHILD_ENV",
    "CLONE_NEWIPC",
    "CLONE_NEWNET",
    "CLONE_NEWNS",
    "CLONE_NEWPID",
    "CLONE_NEWUSER",
    "CLONE_NEWUTS",
    "DEFAULT_PACKAGES",
    "DEFAULT_PRELOAD",
    "F_GETLK",
    "F_OFD_GETLK",
    "F_OFD_SETLK",
    "F_OFD_SETLKW",
    "F_SETLK",
    "F_SETLKW",
    "Isolation",
    "Job",
    "MAX_BINDS",
    "MS_BIND",
    "MS_NOATIME",
    "MS_NODEV",
    "MS_NODIRATIME",
    "MS_NOEXEC",
    "MS_NOSUID",
    "MS_PRIVATE",
    "MS_RDONLY",
    "MS_REC",
    "MS_RELATIME",
    "MS_REMOUNT",
    "MS_STRICTATIME",
    "M_ARENA_MAX",
    "PR_CAPBSET_DROP",
    "PR_SET_CHILD_SUBREAPER",
    "PR_SET_NO_NEW_PRIVS",
    "PR_SET_PDEATHSIG",
    "RUN_BIND_DIR",
    "RunResult",
    "SERVER_GRACE_SECONDS",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "UID_BASE",
    "UID_SLOTS",
    "Verdict",
    "WEAK_SANDBOX_OPT_IN",
    "default_sandbox",
    "program",
    "supervisor",
]
