"""A profiler window's Chrome trace, read from the trace's blobs: its place checked against the
blob dataset before reading, and its gzip data unpacked a piece at a time with a bound, so a
crafted window can neither read outside its bytes nor unpack into unbounded memory."""

from __future__ import annotations

import zlib
from typing import Iterator

from ..errors import TraceFormatError
from .format import _open

# A profiler window's gzipped Chrome trace unpacks ~12x (the sample traces); gzip can reach
# ~1,000x. Past this many times its size (and the floor) it is taken for a compression bomb.
PROFILE_MAX_RATIO = 100
PROFILE_MIN_LIMIT = 64 * 2**20
_PROFILE_CHUNK = 4 * 2**20


def profile_chunks(rt, window: int) -> Iterator[bytes]:
    """The Chrome trace of a profiler window, unpacked a piece at a time (memory stays bounded
    whatever the size). The window's offset and size are checked against blobs/bytes before
    anything is read; damaged or oversized gzip data raises TraceFormatError while writing."""
    w = rt.profile_windows
    row = w[w["window"] == window]
    if row.empty:
        known = ", ".join(str(int(x)) for x in w["window"]) or "none"
        raise TraceFormatError(f"{rt.path} has no profiler window {window} (windows: {known})")
    off, n = int(row["trace_offset"].iloc[0]), int(row["trace_nbytes"].iloc[0])
    try:
        with _open(rt.path) as f:
            ds = f["blobs/bytes"]
            if off < 0 or n < 0 or off + n > ds.shape[0]:
                raise TraceFormatError(f"{rt.path}: profiler window {window} lies outside blobs/bytes (bytes "
                                       f"{off:,} to {off + n:,} of {ds.shape[0]:,}); the trace is damaged or cut short")
            packed = ds[off:off + n].tobytes()
    except (KeyError, OSError, ValueError) as e:
        raise TraceFormatError(f"{rt.path}: profiler window {window} cannot be read ({e})") from None
    return _gunzip(packed, max(PROFILE_MIN_LIMIT, PROFILE_MAX_RATIO * n), f"{rt.path}: profiler window {window}")


def _gunzip(packed: bytes, limit: int, what: str) -> Iterator[bytes]:
    total = 0
    try:
        while packed:  # gzip members, one after the other
            d = zlib.decompressobj(wbits=31)
            data = packed
            while not d.eof:
                chunk = d.decompress(data, _PROFILE_CHUNK)
                if not chunk and len(d.unconsumed_tail) == len(data):
                    break  # no progress: the data ends before the gzip stream does
                data = d.unconsumed_tail
                total += len(chunk)
                if total > limit:
                    raise TraceFormatError(f"{what} unpacks to more than {limit:,} bytes; refused as a "
                                           "compression bomb")
                if chunk:
                    yield chunk
            if not d.eof:
                raise TraceFormatError(f"{what} is cut short (its gzip data ends early)")
            packed = d.unused_data
    except zlib.error as e:
        raise TraceFormatError(f"{what} cannot be unpacked ({e})") from None
