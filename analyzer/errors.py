"""Errors about unusable input. The CLI turns each into one line and exit code 2."""


class TraceError(Exception):
    """A run directory or trace file that cannot be analyzed; the message says why and what to do."""


class TraceNotFoundError(TraceError):
    pass


class TraceFormatError(TraceError):
    pass


class SchemaVersionError(TraceError):
    pass


class ConfigError(Exception):
    """A thresholds file (``--config FILE.toml``) that cannot be used; the message names the file,
    the table and the key, and lists the valid ones. Not a TraceError: the trace may be fine."""


class ClusterError(Exception):
    """A ``--scheduler`` that cannot be used: a malformed address, a scheduler that does not
    answer, Dask not installed. Not a TraceError: the trace may be fine."""
