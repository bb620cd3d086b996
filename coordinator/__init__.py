"""cohortgate's coordinator: kept free of server imports so the agent can import the manifest."""
