"""Where cohorts live: the state interface, its in-memory implementation, the history."""
