"""RankTrace's low-level readers: a dataset read whole, in chosen rows or a block at a time, and
a table's columns cut to the rows all of them hold (a kill can leave one a row longer). Every
read checks what it got (numbers, dimensions) and turns an unreadable dataset into
TraceFormatError."""

from __future__ import annotations

import contextlib
from functools import cached_property

import numpy as np
import pandas as pd

from ..errors import TraceFormatError
from . import schema, upgrade
from .format import _PER_STEP_TABLES, _open, _texts
from .streaming import _gather, _row_selection, _width, block_rows


class TableReads:
    """Mixed into RankTrace: needs its ``path``, ``n_steps`` and ``step_index``."""

    _held = None  # the file while held()
    # While held: the lookups made, {name: f[name]} and {name: name in f}. A rank pass made ~265
    # (~20-40 us each in h5py, a quarter of its time) of ~85 names; now ~85. The file is read-only
    # and the dicts go with the hold (one rank's names at a time, however many ranks).
    _objects = _present = None

    @contextlib.contextmanager
    def held(self):
        """Keep the file open for the reads made inside (``info``'s paragraph of a rank makes
        ~80): one open, not one per read. Reentrant."""
        if self._held is not None:
            yield self
            return
        with _open(self.path) as f:
            self._held, self._objects, self._present = f, {}, {}
            try:
                yield self
            finally:
                self._held = self._objects = self._present = None

    def _get(self, f, name: str):
        """f[name]; looked up once while held. A failed lookup raises each time (not kept)."""
        if f is not self._held:
            return f[name]
        obj = self._objects.get(name)
        if obj is None:
            obj = self._objects[name] = f[name]
        return obj

    def _in(self, f, name: str) -> bool:
        """name in f; asked once while held."""
        if f is not self._held:
            return name in f
        present = self._present.get(name)
        if present is None:
            # Mostly asked before a read of it: open it now (an object that opens is in f).
            try:
                self._get(f, name)
                present = True
            except Exception:  # (absent, or a link HDF5 will not follow: h5py's own answer)
                present = name in f
            self._present[name] = present
        return present

    def release(self) -> None:
        """Forget what the lazy properties read (they read it again if asked): a run of 10,000
        ranks keeps ~60 KB a rank of DataFrames after ``info`` has printed its paragraph."""
        for cls in type(self).__mro__:
            for name, attr in vars(cls).items():
                if isinstance(attr, cached_property):
                    self.__dict__.pop(name, None)

    @contextlib.contextmanager
    def _opened(self):
        """The file, open: the one held() keeps, or opened for this read alone."""
        if self._held is not None:
            yield self._held
        else:
            with _open(self.path) as f:
                yield f

    def _read(self, name: str, rows: int | None = None, text: bool = False, ndim: int | None = None) -> np.ndarray:
        """A dataset (its first ``rows`` rows), read-only; numbers unless ``text``, of ``ndim``
        dimensions if given."""
        try:
            with self._opened() as f:
                ds = self._get(f, name)
                arr = ds[: rows] if rows is not None else ds[()]
        except (KeyError, OSError, ValueError) as e:
            raise TraceFormatError(f"{self.path}: cannot read {name} ({e})") from None
        arr = np.asarray(arr)
        if not text:
            schema.numeric(self.path, name, arr)
        if ndim is not None and arr.ndim != ndim:
            raise TraceFormatError(f"{self.path}: {name} has shape {arr.shape}, not {ndim}-D; the trace is damaged")
        arr.flags.writeable = False
        return arr

    def _frame(self, data: np.ndarray, index: np.ndarray, columns: list[str], name: str) -> pd.DataFrame:
        if data.ndim != 2 or data.shape[1] != len(columns):
            raise TraceFormatError(f"{self.path}: {name} is {data.shape[1:]} wide, not one column per name "
                                   f"({len(columns):,}); the trace is damaged")
        df = pd.DataFrame(data, index=pd.Index(index, name="step"), columns=columns, copy=False)
        return df

    def _read_rows(self, name: str, rows, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(row indices, the rows) of the first n rows of a dataset: all of them (rows=None), a
        slice, or chosen rows. Chosen rows are gathered a block at a time: memory is bounded by
        the rows asked for, never by the length of the table."""
        sel = _row_selection(slice(None) if rows is None else rows, n)
        try:
            with self._opened() as f:
                ds = self._get(f, name)
                if isinstance(sel, slice) and sel.step == 1:
                    idx = np.arange(sel.start, max(sel.start, sel.stop))
                    out = ds[sel.start:max(sel.start, sel.stop)]
                else:
                    idx = np.arange(sel.start, sel.stop, sel.step) if isinstance(sel, slice) else sel
                    out = _gather(ds, idx)
        except (KeyError, OSError, ValueError) as e:
            raise TraceFormatError(f"{self.path}: cannot read {name} ({e})") from None
        out = schema.numeric(self.path, name, np.asarray(out))
        out.flags.writeable = False
        return idx, out

    def blocks(self, name: str, stop: int | None = None, start: int = 0):
        """Yield (first row, rows) of a dataset, one block of rows at a time, up to ``stop``
        (default: the steps every per-step table holds, for per-step tables)."""
        if stop is None:
            table = name.split("/", 1)[0]
            stop = self.n_steps if table in _PER_STEP_TABLES else None
        try:
            with self._opened() as f:
                ds = self._get(f, name)
                stop = ds.shape[0] if stop is None else min(stop, ds.shape[0])
                if ds.dtype.kind not in "iufb" or ds.ndim not in (1, 2):
                    raise TraceFormatError(f"{self.path}: {name} holds {ds.dtype} {ds.shape}, not a "
                                           "table of numbers; the trace is damaged")
                step = block_rows(_width(ds))
                for a in range(start, stop, step):
                    block = np.asarray(ds[a:min(a + step, stop)])
                    block.flags.writeable = False
                    yield a, block
        except (KeyError, OSError, ValueError) as e:
            raise TraceFormatError(f"{self.path}: cannot read {name} ({e})") from None

    def rows_in_span(self, lo: float, hi: float) -> slice:
        """The rows of the per-step tables whose step lies in [lo, hi]."""
        idx = self.step_index
        return slice(int(np.searchsorted(idx, lo, "left")), int(np.searchsorted(idx, hi, "right")))

    def _sampled_steps(self, table: str, cols) -> np.ndarray:
        with self.held():
            try:
                with self._opened() as f:
                    n = min(self._get(f, f"{table}/{c}").shape[0] for c in ("step", *cols))
            except (KeyError, OSError) as e:
                raise TraceFormatError(f"{self.path}: cannot read {table} ({e})") from None
            return self._read(f"{table}/step", n, ndim=1)

    def _n_rows(self, table: str, cols) -> int:
        """Rows every column of a table holds (a kill can leave one a row longer); 0 if the
        table is absent (an older trace). Columns an older trace lacks (upgrade.py) do not count."""
        try:
            with self._opened() as f:
                if not self._in(f, table):
                    return 0
                names = [f"{table}/{c}" for c in cols]
                return min(self._get(f, n).shape[0] for n in names if self._in(f, n) or not upgrade.added(n))
        except (KeyError, OSError) as e:
            raise TraceFormatError(f"{self.path}: cannot read {table} ({e})") from None

    def _has(self, name: str) -> bool:
        with self._opened() as f:
            return self._in(f, name)

    def _table(self, table: str, cols: tuple[str, ...], texts: tuple[str, ...] = (),
               ndim: int | None = None) -> dict[str, np.ndarray]:
        """All columns of a table, cut to the rows every column holds (a kill can leave one
        column a row longer); an absent table (older trace) reads as empty, a column added after
        it was written as upgrade.py says. Columns not in ``texts`` must hold numbers; all of
        ``ndim`` dimensions if given."""
        with self.held():  # (one open for the table's reads)
            if not self._has(table):
                return {c: np.zeros(0) for c in cols}
            n, lacking = self._n_rows(table, cols), self._lacking(table, cols)
            out = {}
            for c in cols:
                out[c] = upgrade.column(f"{table}/{c}", n, out) if c in lacking else \
                    self._read(f"{table}/{c}", n, text=c in texts, ndim=ndim)
            return out

    def _lacking(self, table: str, cols) -> set[str]:
        """The columns of a table this trace lacks and the reader fills in (upgrade.py)."""
        with self._opened() as f:
            return {c for c in cols if upgrade.added(f"{table}/{c}") and not self._in(f, f"{table}/{c}")}

    def _texts_table(self, table: str, cols: tuple[str, ...], texts: tuple[str, ...]) -> pd.DataFrame:
        """A table as a DataFrame, its text columns decoded."""
        df = pd.DataFrame(self._table(table, cols, texts, ndim=1))
        for c in texts:
            df[c] = _texts(df[c])
        return df

    def _width_of(self, name: str) -> int:
        try:
            with self._opened() as f:
                if not self._in(f, name):
                    return 0
                ds = self._get(f, name)
                return int(ds.shape[1]) if ds.ndim == 2 else 0
        except (KeyError, OSError) as e:
            raise TraceFormatError(f"{self.path}: cannot read {name} ({e})") from None
