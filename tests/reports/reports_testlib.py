"""Constants shared by the report tests (conftest.py builds the traces)."""

# Module names as a trace attached to a bug ticket may hold them: they must stay text.
HOSTILE_SCRIPT = "<script>alert(1)</script>"
HOSTILE_IMG = "<img src=x onerror=alert(1)>"
