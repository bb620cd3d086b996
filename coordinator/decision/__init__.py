"""The pure formation decision: the check registry, shard coverage, verdicts and reports."""
