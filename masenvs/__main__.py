"""`python -m masenvs ...`: the same as the `masenvs` command."""

from masenvs.cli import main

raise SystemExit(main())
