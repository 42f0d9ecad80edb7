"""NOTE TO THE ENGINEER WRITING THIS FILE (from the lead, replace this docstring with yours):

verifiers 0.4 cannot be installed into /work/main/.venv: it needs protobuf >= 6 (via
prime-sandboxes) while autogen-core 0.7 (masenvs[frameworks]) pins protobuf ~= 5.29. Do NOT
`pip install verifiers` into /work/main/.venv. It lives in its own venv instead:

    scripts/verifiers_env.sh        # builds /work/main/.venv-verifiers (masenvs -e .[verifiers]
                                    # + pytest), prints its python on the last line

Use that python (`/work/main/.venv-verifiers/bin/python`) to develop and run the verifiers
tests. Put the tests that need verifiers in tests/verifiers_env/test_*.py (they run inside
that venv: `.venv-verifiers/bin/python -m pytest tests/verifiers_env`), and add ONE test to
the main suite, tests/test_integration_verifiers.py, that runs them in a subprocess with
$MASENVS_VERIFIERS_PYTHON (set by .ci/run from scripts/verifiers_env.sh): skipped with a
clear reason when the variable is unset locally, failed when CI=true and it is missing (the
same rule as the vllm tests, see tests/test_vllm_real.py). The server side (masenvs serve
with the tiny model) can run from either venv.
"""
