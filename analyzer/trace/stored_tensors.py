"""RankTrace's readers of whole stored tensors (parameter snapshots, sampled activations and
gradients, the black box) and of the fixed-bin histograms."""

from __future__ import annotations

import zlib
from functools import cached_property

import numpy as np
import pandas as pd

from ..errors import TraceFormatError
from .format import HIST_KINDS, _open, parse_json


class StoredTensors:
    """Mixed into RankTrace: needs its ``_read``, ``_has``, ``_table``, ``_texts_table`` and
    ``_sampled_steps``."""

    # -- stored tensors: snapshots, samples, the black box (docs/trace_format.md) --------------
    @cached_property
    def stored_tensors(self) -> pd.DataFrame:
        """One row per stored tensor: source (snapshot | sample | blackbox), step, name, role,
        dtype, shape (tuple), location (blobs | snapshots), offset, nbytes. Snapshot rows whose
        slot was reused since are still listed; ``snapshots`` says which are kept."""
        cols = ("source", "step", "name", "role", "dtype", "shape", "location", "offset", "nbytes")
        df = self._texts_table("tensors", cols, ("source", "name", "role", "dtype", "shape", "location"))
        shapes = []
        for text in df["shape"]:
            shape = parse_json(text)
            if not isinstance(shape, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in shape):
                raise TraceFormatError(f"{self.path}: a stored tensor has a bad shape {text[:40]!r}")
            shapes.append(tuple(shape))
        df["shape"] = shapes
        return df

    @cached_property
    def snapshots(self) -> pd.DataFrame:
        """The parameter snapshots the trace still holds, oldest first: step, slot, offset,
        nbytes, crc32, dtype ("exact" or the half precision floats were stored in). A slot holds
        the snapshot of its latest row (older ones were overwritten to keep the disk budget)."""
        cols = ("step", "slot", "offset", "nbytes", "crc32", "dtype")
        df = self._texts_table("snapshots", cols, ("dtype",))
        if not len(df):
            return df
        df = df.drop_duplicates("slot", keep="last")
        t = self.stored_tensors
        have = set(t.loc[(t["source"] == "snapshot"), "step"].astype(int))
        df = df[df["step"].astype(int).isin(have)]
        return df.sort_values("step").reset_index(drop=True)

    @cached_property
    def blackbox(self) -> pd.DataFrame:
        """The black box, if it fired: step, trigger, params_at (start_of_step: before the bad
        update; end_of_step: after it; at_exit), detail (dict)."""
        df = self._texts_table("blackbox", ("step", "trigger", "params_at", "detail"),
                               ("trigger", "params_at", "detail"))
        details = []
        for text in df["detail"]:
            d = parse_json(text, {})
            details.append(d if isinstance(d, dict) else {})
        df["detail"] = details
        return df

    def tensors_of(self, source: str, step: int) -> pd.DataFrame:
        """The stored tensors of one snapshot, sample step or black box (rows of stored_tensors)."""
        t = self.stored_tensors
        rows = t[(t["source"] == source) & (t["step"] == step)]
        if source == "snapshot":
            snap = self.snapshots[self.snapshots["step"] == step]
            if snap.empty:
                return rows.iloc[0:0]
            lo, n = int(snap["offset"].iloc[-1]), int(snap["nbytes"].iloc[-1])
            rows = rows[(rows["location"] == "snapshots") & (rows["offset"] >= lo) & (rows["offset"] + rows["nbytes"] <= lo + n)]
            rows = rows.drop_duplicates("name", keep="last")
        return rows.reset_index(drop=True)

    def read_tensor_bytes(self, rows: pd.DataFrame, verify_snapshot: int | None = None) -> list[bytes]:
        """The raw bytes of stored tensors (rows of stored_tensors), in order; with
        ``verify_snapshot`` (a step), first check that snapshot's slot against its crc32."""
        out = []
        try:
            with _open(self.path) as f:
                spans = [(loc, int(off), int(n))
                         for loc, off, n in zip(rows["location"], rows["offset"], rows["nbytes"])]
                if verify_snapshot is not None:
                    snap = self.snapshots[self.snapshots["step"] == verify_snapshot].iloc[-1]
                    lo, n = int(snap["offset"]), int(snap["nbytes"])
                    self._check_spans(f, [("snapshots", lo, n)])
                    slot = f["snapshots/bytes"][lo:lo + n].tobytes()
                    if len(slot) != n or (zlib.crc32(slot) & 0xFFFFFFFF) != (int(snap["crc32"]) & 0xFFFFFFFF):
                        raise TraceFormatError(
                            f"{self.path}: the snapshot of step {verify_snapshot} is incomplete (the job was "
                            "killed while its slot was being rewritten)")
                self._check_spans(f, spans)
                for loc, off, n in spans:
                    ds = f["snapshots/bytes" if loc == "snapshots" else "blobs/bytes"]
                    out.append(ds[off:off + n].tobytes())
        except (KeyError, OSError, ValueError, OverflowError) as e:
            raise TraceFormatError(f"{self.path}: stored tensors cannot be read ({e})") from None
        return out

    def _check_spans(self, f, spans) -> None:
        """Before anything is read: every (location, offset, nbytes) lies inside its dataset, and
        the spans of one location add up to no more than it holds (the recorder never stores two
        tensors in the same bytes; overlapping rows could make a small file ask for terabytes)."""
        total: dict[str, int] = {}
        for loc, off, n in spans:
            name = "snapshots/bytes" if loc == "snapshots" else "blobs/bytes"
            size = f[name].shape[0]
            if off < 0 or n < 0:
                raise TraceFormatError(f"{self.path}: a stored tensor has a bad place in {name} "
                                       f"(offset {off:,}, {n:,} bytes); the trace is damaged")
            if off + n > size:
                raise TraceFormatError(f"{self.path}: a stored tensor lies past the end of {name}, cut short "
                                       f"({max(0, size - off):,} of {n:,} bytes present)")
            total[name] = total.get(name, 0) + n
            if total[name] > size:
                raise TraceFormatError(f"{self.path}: the stored tensors asked for add up to more bytes than "
                                       f"{name} holds ({size:,}); the trace is damaged")

    @cached_property
    def histogram_bins(self) -> tuple[np.ndarray, np.ndarray]:
        """(lower, upper) edges of the histogram bins (NaN bin: NaN, NaN; -Inf and +Inf bins:
        -inf and +inf); empty arrays in traces without histograms."""
        if not self._has("histogram_bins/lower"):
            return np.zeros(0), np.zeros(0)
        return self._read("histogram_bins/lower"), self._read("histogram_bins/upper")

    def histograms(self, kind: str, rows=None) -> tuple[np.ndarray, list[str], np.ndarray]:
        """(steps, names, counts[steps, names, bins]) of the sampled histograms of kind weight,
        grad (names: parameters) or activation (names: modules). Counts of -1: not recorded
        (no gradient, module not called). ``rows``: the row numbers to read (sorted), to bound
        memory on a long run (all rows by default). Empty in traces without histograms."""
        if kind not in HIST_KINDS:
            raise ValueError(f"unknown histogram kind {kind!r}; one of {HIST_KINDS}")
        lower, _ = self.histogram_bins
        if not lower.size:
            return np.zeros(0, np.int64), [], np.zeros((0, 0, 0), np.int32)
        table, index = (("histogram_modules/module", self.module_names) if kind == "activation"
                        else ("histogram_params/param", self.param_names))
        idx = self._read(table, ndim=1)
        names = [index[i] if 0 <= i < len(index) else f"#{i}" for i in idx]
        steps = self.histogram_steps
        rows = np.arange(len(steps)) if rows is None else np.unique(np.asarray(rows, dtype=np.int64))
        rows = rows[(rows >= 0) & (rows < len(steps))]
        try:
            with _open(self.path) as f:
                data = f[f"histograms/{kind}"][rows.tolist()] if rows.size else np.zeros((0, len(names) * lower.size))
        except (KeyError, OSError, ValueError) as e:
            raise TraceFormatError(f"{self.path}: cannot read histograms/{kind} ({e})") from None
        data = np.asarray(data)
        if data.ndim != 2 or data.shape[1] != len(names) * lower.size:
            raise TraceFormatError(f"{self.path}: histograms/{kind} is {data.shape[1:]} wide, not {len(names):,} "
                                   f"tensors x {lower.size} bins; the trace is damaged")
        counts = data.reshape(len(rows), len(names), lower.size)
        return steps[rows], names, counts

    @cached_property
    def histogram_steps(self) -> np.ndarray:
        """The steps of the histogram rows every histogram dataset holds (empty without them)."""
        if not self._has("histograms/step"):
            return np.zeros(0, np.int64)
        return np.asarray(self._sampled_steps("histograms", HIST_KINDS), dtype=np.int64)
