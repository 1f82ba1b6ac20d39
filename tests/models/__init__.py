"""Real model code from other projects, vendored unchanged for the tests (each file says whence)."""
