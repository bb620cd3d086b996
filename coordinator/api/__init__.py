"""cohortgate wire API."""
