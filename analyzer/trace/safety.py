"""What a trace file may hold, checked once per file before any of its data is read.

Traces come from bug tickets. HDF5 can make a reader open other files (external links, virtual
datasets, external raw storage), load a filter plugin (a shared library) for an unknown filter,
or allocate whatever a damaged header declares. The recorder uses none of these: every object is
reached by a hard link, every dataset is contiguous, compact or chunked in this file, with no
filter (a repacked copy may add gzip, shuffle or fletcher32, which HDF5 has built in). Anything
else is refused here, with the object at fault named, and ``format._open`` calls this on every
open of a trace, so a reader added later cannot skip it (tests/analyzer/test_refused_hdf5.py).
"""

from __future__ import annotations

import os

import h5py
import numpy as np
from h5py import h5d, h5z

from ..errors import TraceFormatError

# Filters HDF5 (or h5py, for LZF) has built in, with the most a chunk can expand: zlib's
# deflate tops out near 1032:1; shuffle and fletcher32 do not shrink data.
_FILTER_RATIO = {h5z.FILTER_DEFLATE: 1100, h5z.FILTER_SHUFFLE: 1, h5z.FILTER_FLETCHER32: 1,
                 h5z.FILTER_LZF: 110}
# A real trace holds ~150 objects; the recorder never writes a chunk over a few MiB.
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

_checked: dict[tuple, None] = {}  # (path, inode, size, mtime) of files that passed


def check_trace_file(f: h5py.File, path: str) -> None:
    """Raise TraceFormatError if anything in ``f`` reaches outside the file or declares more
    data than the file can hold. Cheap (metadata only), and done once per version of a file."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key in _checked:
        return
    _Walk(path, st.st_size).run(f)
    if len(_checked) > 256:
        _checked.clear()
    _checked[key] = None


class _Walk:
    def __init__(self, path: str, file_size: int):
        self.path = path
        self.file_size = file_size
        self.objects = 0
        self.compressed = [0.0, 0, "", 0.0]  # declared bytes, stored bytes, the largest: name, bytes

    def refuse(self, name: str, why: str) -> None:
        raise TraceFormatError(f"{self.path}: refused: /{name} {why}; a torchautopsy trace never does "
                               "this (a crafted or foreign file), so it is not read")

    def run(self, f: h5py.File) -> None:
        try:
            self.check_attrs("", f)
            self.check_links("", f)
            # visititems follows hard links only, each object once (no cycles).
            f.visititems(self.visit)
        except TraceFormatError:
            raise
        except (OSError, RuntimeError, ValueError, KeyError, TypeError) as e:
            raise TraceFormatError(f"{self.path} is truncated or corrupt (its structure cannot be read: "
                                   f"{e}); copy it again from the job's run directory") from None
        declared, stored, largest, _ = self.compressed
        if declared > MAX_OVERALL_RATIO * stored + SLACK_BYTES:
            self.refuse(largest, f"and the other compressed datasets declare {int(declared):,} bytes stored in "
                                 f"{stored:,} (a compression bomb)")

    def visit(self, name: str, obj) -> None:
        self.objects += 1
        if self.objects > MAX_OBJECTS:
            self.refuse("", f"holds more than {MAX_OBJECTS:,} objects")
        self.check_attrs(name, obj)
        if isinstance(obj, h5py.Group):
            self.check_links(name, obj)
        elif isinstance(obj, h5py.Dataset):
            self.check_dataset(name, obj)

    def check_links(self, name: str, group: h5py.Group) -> None:
        prefix = f"{name}/" if name else ""
        for child in group:
            link = group.get(child, getlink=True)
            if isinstance(link, h5py.ExternalLink):
                self.refuse(prefix + child, f"is an external link to {link.filename!r}")
            if not isinstance(link, h5py.HardLink):
                self.refuse(prefix + child, f"is a {type(link).__name__} (only hard links are read)")

    def check_attrs(self, name: str, obj) -> None:
        for key in obj.attrs:
            aid = obj.attrs.get_id(key)
            self.check_type(f"{name}@{key}", aid.dtype)
            self.check_size(f"{name}@{key}", aid.shape, aid.dtype, self.file_size)

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

    def check_dataset(self, name: str, ds: h5py.Dataset) -> None:
        self.check_type(name, ds.dtype)
        if ds.ndim not in (1, 2):  # the recorder writes columns and steps x tensors tables only
            self.refuse(name, f"has {ds.ndim} dimensions (a trace's datasets have 1 or 2)")
        dcpl = ds.id.get_create_plist()
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
            chunk = int(np.prod(ds.chunks, dtype=np.int64)) * max(ds.dtype.itemsize, _VLEN_ITEM)
            if chunk > MAX_CHUNK_BYTES:
                self.refuse(name, f"declares chunks of {chunk:,} bytes")
            stored = ds.id.get_storage_size()
            limit = ratio * stored + SLACK_BYTES
            if ratio > 1:
                self.count_compressed(name, float(np.prod(ds.shape, dtype=np.float64)) * ds.dtype.itemsize, stored)
        elif layout in (h5d.CONTIGUOUS, h5d.COMPACT):
            limit = self.file_size + SLACK_BYTES
        else:
            self.refuse(name, f"has an unknown storage layout ({layout})")
        self.check_size(name, ds.shape, ds.dtype, limit)
