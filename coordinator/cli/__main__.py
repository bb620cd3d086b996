"""`python -m coordinator.cli`: the cohortgate command."""

from coordinator.cli.main import main

raise SystemExit(main())
