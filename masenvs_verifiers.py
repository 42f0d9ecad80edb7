"""`vf-eval masenvs-verifiers ...`: verifiers imports an environment id as a top-level module
(prime-rl's env workers too, each in a fresh process), so masenvs installs this one, which is
masenvs.integrations.verifiers: every masenvs env as a verifiers environment."""

import sys

from masenvs.integrations import verifiers as _environment

sys.modules[__name__] = _environment
