"""These tests need verifiers, which lives in its own venv (scripts/verifiers_env.sh); the main
suite runs them there through tests/test_integration_verifiers.py and collects nothing here."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("verifiers") else ["*.py"]
