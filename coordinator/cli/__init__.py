"""The cohortgate command: serve, relay, run, status, watch, explain."""
