"""`python -m cohortgate.coordinator.cli`: the cohortgate command."""

from cohortgate.coordinator.cli.main import main

raise SystemExit(main())
