"""What a trace file may hold, checked once per file before any of its data is read.

Traces come from bug tickets. HDF5 can make a reader open other files (external links, virtual
datasets, external raw storage), load a filter plugin (a shared library) for an unknown filter,
or allocate whatever a damaged header declares. The recorder uses none of these: every object is
reached by a hard link, every dataset is contiguous, compact or chunked in this file, with no
filter (a repacked copy may add gzip, shuffle or fletcher32, which HDF5 has built in). Anything
else is refused here, with the object at fault named, and ``format._open`` calls this on every
open of a trace, so a reader added later cannot skip it (tests/analyzer/test_refused_hdf5.py).

A file is checked once: a file that passed is known by its identity (device, inode, size,
modification time in ns, of the file HDF5 has open), and every later open of that version of it,
in this process or in a worker told of it (``trust``), skips the walk. The deadline probe
(probe.py) runs the one walk in its child with ``decoding(True)``: the walk then also reads what
HDF5 decodes (every attribute, string datasets whole, the first and last row of every chunked
dataset), so one pass both checks a file and proves it decodes in bounded time. The walk uses
h5py's low-level calls: one object opened at a time, no high-level wrapper per object.
"""

from __future__ import annotations

import os

import h5py
import numpy as np
from h5py import h5a, h5d, h5g, h5l, h5o, h5s, h5z

from ..errors import TraceFormatError

# Filters HDF5 (or h5py, for LZF) has built in, with the most a chunk can expand: zlib's
# deflate tops out near 1032:1; shuffle and fletcher32 do not shrink data.
_FILTER_RATIO = {h5z.FILTER_DEFLATE: 1100, h5z.FILTER_SHUFFLE: 1, h5z.FILTER_FLETCHER32: 1,
                 h5z.FILTER_LZF: 110}
# A real trace holds ~300 objects; the recorder never writes a chunk over a few MiB.
MAX_OBJECTS = 20_000
MAX_CHUNK_BYTES = 64 * 2**20
# Rows a killed writer may have declared (resized) but not yet written read as fill values: a
# dataset may declare this much more than its stored bytes account for. It bounds what one read
# can allocate beyond the data really in the file.
SLACK_BYTES = 16 * 2**20
# A repacked trace's compressed datasets expand a few times overall (all-zero columns alone reach
# zlib's ~1030:1, but they are small beside the float statistics); a compression bomb needs far
# more. Past this overall ratio the file is refused before anything is decompressed.
MAX_OVERALL_RATIO = 32
_VLEN_ITEM = 16  # bytes of a variable-length string's handle as HDF5 stores it
# Files remembered as passed (~100 bytes each: four integers): more than any run directory holds;
# past it the oldest are forgotten (and checked again if opened again).
MAX_REMEMBERED = 2**20

Identity = tuple[int, int, int, int]  # device, inode, size, modification time (ns)
_checked: dict[Identity, None] = {}  # files that passed, oldest first
_decoding = [False]  # the probe's child: the walk also decodes (set there only)


def identity(f: h5py.File, path: str) -> Identity:
    """(device, inode, size, mtime_ns) of the file ``f`` has open (of ``path`` where HDF5's
    driver gives no descriptor)."""
    try:
        st = os.fstat(f.id.get_vfd_handle())
    except (OSError, ValueError, TypeError, RuntimeError):
        st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def path_identity(path: str) -> Identity | None:
    """The identity of the file at ``path`` if it passed in this process, else None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    return key if key in _checked else None


def trust(keys) -> None:
    """Remember these identities as passed (checked by the probe's child, or by the parent of
    a worker): an open of a file of that identity is not walked again."""
    for key in keys:
        if key is None:
            continue
        key = tuple(int(k) for k in key)
        _checked.pop(key, None)  # (to the newest end)
        _checked[key] = None
        while len(_checked) > MAX_REMEMBERED:
            del _checked[next(iter(_checked))]


def decoding(on: bool) -> None:
    """In the probe's child: every open walks the file again and also decodes what it holds."""
    _decoding[0] = on


def check_trace_file(f: h5py.File, path: str) -> None:
    """Raise TraceFormatError if anything in ``f`` reaches outside the file or declares more
    data than the file can hold. Cheap (metadata only), and done once per version of a file."""
    key = identity(f, path)
    if key in _checked and not _decoding[0]:
        return
    _Walk(path, key[2], decode=_decoding[0]).run(f)
    trust([key])


def _text(name: bytes) -> str:
    return name.decode("utf-8", "replace")


class _Walk:
    def __init__(self, path: str, file_size: int, decode: bool = False):
        self.path = path
        self.file_size = file_size
        self.decode = decode
        self.objects = 0
        self.compressed = [0.0, 0, "", 0.0]  # declared bytes, stored bytes, the largest: name, bytes
        self.fid = None

    def refuse(self, name: str, why: str) -> None:
        raise TraceFormatError(f"{self.path}: refused: /{name} {why}; a torchautopsy trace never does "
                               "this (a crafted or foreign file), so it is not read")

    def run(self, f: h5py.File) -> None:
        try:
            self.fid = f.id
            root = h5o.open(self.fid, b"/")
            self.check_attrs("", root)
            self.check_links("", root)
            # Follows hard links only, each object once (no cycles), the root excluded.
            h5o.visit(self.fid, self.visit, info=True)
        except TraceFormatError:
            raise
        except (OSError, RuntimeError, ValueError, KeyError, TypeError) as e:
            raise TraceFormatError(f"{self.path} is truncated or corrupt (its structure cannot be read: "
                                   f"{e}); copy it again from the job's run directory") from None
        declared, stored, largest, _ = self.compressed
        if declared > MAX_OVERALL_RATIO * stored + SLACK_BYTES:
            self.refuse(largest, f"and the other compressed datasets declare {int(declared):,} bytes stored in "
                                 f"{stored:,} (a compression bomb)")

    def visit(self, name: bytes, info) -> None:
        self.objects += 1
        if self.objects > MAX_OBJECTS:
            self.refuse("", f"holds more than {MAX_OBJECTS:,} objects")
        text = _text(name)
        if info.type == h5o.TYPE_GROUP:
            oid = h5g.open(self.fid, name)
            self.check_attrs(text, oid)
            self.check_links(text, oid)
        elif info.type == h5o.TYPE_DATASET:
            oid = h5d.open(self.fid, name)
            self.check_attrs(text, oid)
            self.check_dataset(text, oid)
        else:  # a named data type: its attributes only
            self.check_attrs(text, h5o.open(self.fid, name))

    def check_links(self, name: str, gid) -> None:
        prefix = f"{name}/" if name else ""
        found = []

        def soft(child: bytes, info):
            if info.type != h5l.TYPE_HARD:
                found.append((child, info.type))
                return 1  # (stops the iteration)
            return None

        gid.links.iterate(soft, info=True)
        if not found:
            return
        child, kind = found[0]
        if kind == h5l.TYPE_EXTERNAL:
            filename = gid.links.get_val(child)[0]
            self.refuse(prefix + _text(child), f"is an external link to {_text(filename)!r}")
        what = "SoftLink" if kind == h5l.TYPE_SOFT else f"link of type {kind}"
        self.refuse(prefix + _text(child), f"is a {what} (only hard links are read)")

    def check_attrs(self, name: str, oid) -> None:
        for i in range(h5a.get_num_attrs(oid)):
            aid = h5a.open(oid, index=i)
            label = f"{name}@{_text(aid.name)}"
            dtype = aid.dtype
            self.check_type(label, dtype)
            self.check_size(label, aid.shape, dtype, self.file_size)
            if self.decode and aid.get_space().get_simple_extent_type() != h5s.NULL:
                aid.read(np.empty(aid.shape, dtype=dtype))

    def count_compressed(self, name: str, declared: float, stored: int) -> None:
        c = self.compressed
        c[0] += declared
        c[1] += stored
        if declared > c[3]:
            c[2], c[3] = name, declared

    def check_type(self, name: str, dtype: np.dtype) -> None:
        if h5py.check_string_dtype(dtype) is not None:
            return
        if dtype.kind in "iufb" and dtype.shape == ():
            return
        self.refuse(name, f"has data type {dtype} (only numbers and strings are read)")

    def check_size(self, name: str, shape, dtype: np.dtype, limit: int) -> None:
        item = _VLEN_ITEM if h5py.check_vlen_dtype(dtype) is not None else dtype.itemsize
        n = item
        for d in shape or ():
            n *= int(d)
            if n > limit:
                self.refuse(name, f"declares shape {tuple(shape)}: more data than the file holds "
                                  f"({self.file_size:,} bytes)")

    def check_dataset(self, name: str, dsid) -> None:
        dtype = dsid.dtype
        self.check_type(name, dtype)
        space = dsid.get_space()
        ndim = space.get_simple_extent_ndims()
        if ndim not in (1, 2):  # the recorder writes columns and steps x tensors tables only
            self.refuse(name, f"has {ndim} dimensions (a trace's datasets have 1 or 2)")
        shape = space.get_simple_extent_dims()
        dcpl = dsid.get_create_plist()
        layout = dcpl.get_layout()
        if layout == h5d.VIRTUAL:
            self.refuse(name, "is a virtual dataset (its data would come from other files)")
        if dcpl.get_external_count():
            ext = dcpl.get_external(0)[0]
            self.refuse(name, f"stores its data in an external file ({ext.decode('utf-8', 'replace')!r})")
        ratio = 1
        for i in range(dcpl.get_nfilters()):
            code = dcpl.get_filter(i)[0]
            if code not in _FILTER_RATIO:
                self.refuse(name, f"uses HDF5 filter {code}, which would load a plugin library")
            ratio = max(ratio, _FILTER_RATIO[code])
        if layout == h5d.CHUNKED:
            chunk = int(np.prod(dcpl.get_chunk(), dtype=np.int64)) * max(dtype.itemsize, _VLEN_ITEM)
            if chunk > MAX_CHUNK_BYTES:
                self.refuse(name, f"declares chunks of {chunk:,} bytes")
            stored = dsid.get_storage_size()
            limit = ratio * stored + SLACK_BYTES
            if ratio > 1:
                self.count_compressed(name, float(np.prod(shape, dtype=np.float64)) * dtype.itemsize, stored)
        elif layout in (h5d.CONTIGUOUS, h5d.COMPACT):
            limit = self.file_size + SLACK_BYTES
        else:
            self.refuse(name, f"has an unknown storage layout ({layout})")
        self.check_size(name, shape, dtype, limit)
        if self.decode and shape[0] and all(shape):
            _decode(dsid, shape, dtype, layout == h5d.CHUNKED)


def _decode(dsid, shape: tuple[int, ...], dtype: np.dtype, chunked: bool) -> None:
    """Read what makes HDF5 decode a dataset's structures (the probe's child): strings whole (the
    global heap), the first and last row of a chunked table (its chunk index). A contiguous or
    compact table's rows are raw bytes at a known place, decoded by nothing: not read."""
    if dtype.kind in "OSU" or h5py.check_string_dtype(dtype) is not None:
        dsid.read(h5s.ALL, h5s.ALL, np.empty(shape, dtype=dtype))
    elif chunked:
        count = (1,) + tuple(shape[1:])
        for row in (0, shape[0] - 1):
            space = dsid.get_space()
            space.select_hyperslab((row,) + (0,) * (len(shape) - 1), count)
            dsid.read(h5s.create_simple(count), space, np.empty(count, dtype=dtype))
