"""The coordinator's core on one event loop, and what it tells the world: metrics, status views."""
