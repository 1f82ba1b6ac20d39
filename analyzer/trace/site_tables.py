"""RankTrace's readers of the per-call-site tables: activation-function activity (windowed),
attention (sampled) and module outputs. A site table names its modules by index; these readers
turn the indices into names and check the sites' offsets against the width of the table they
index."""

from __future__ import annotations

from functools import cached_property

import numpy as np
import pandas as pd

from ..errors import TraceFormatError
from . import upgrade
from .streaming import _WINDOWS_PER_READ


class SiteTables:
    """Mixed into RankTrace: needs its ``module_names`` and the readers of TableReads
    (``_read_rows``, ``_frame``, ``_has``, ``_n_rows``, ``_table``, ``_texts_table``, ``_width_of``)."""

    def _sites(self, table: str, cols: tuple[str, ...], *texts: str) -> pd.DataFrame:
        """A site table with its text columns decoded and module indices turned into names
        (``module``), the index kept as ``module_index``."""
        df = self._texts_table(table, cols, texts)
        df["module_index"] = df["module"].astype(int)
        df["module"] = [self.module_names[i] if 0 <= i < len(self.module_names) else f"#{i}"
                        for i in df["module_index"]]
        return df

    @cached_property
    def activity_sites(self) -> pd.DataFrame:
        """Activation-function call sites: module (name), function, call, param, unit_dim,
        units, bit_offset, first_step. One row per site, in the order they were first seen."""
        cols = ("module", "function", "call", "param", "unit_dim", "units", "bit_offset", "first_step")
        return self._sites("activity_sites", cols, "function")

    def activity_windows(self):
        """Yield (step_start, step_end, steps_seen per site, ever_positive bits per unit,
        saturated_frac per site, steps watched), one window at a time, oldest first. A site
        is seen only on watched steps (schema 2: every activations_every-th step; before it,
        every step of the window)."""
        for t, bits in self._activity_blocks():
            for i in range(len(bits)):
                yield (int(t["step_start"][i]), int(t["step_end"][i]), t["steps_seen"][i], bits[i],
                       t["saturated_frac"][i], int(t["steps_watched"][i]))

    def _activity_blocks(self):
        """The activity table a block of windows at a time (a long run has tens of thousands):
        (its columns, ever_positive unpacked: windows x the sites' bits, bool)."""
        cols = ("step_start", "step_end", "steps_seen", "ever_positive", "saturated_frac", "steps_watched")
        n, lacking = self._n_rows("activity", cols), self._lacking("activity", cols)
        n_bits = self._site_extent(self.activity_sites, "bit_offset", "units", "activity/ever_positive", 8)
        for start in range(0, n, _WINDOWS_PER_READ):
            stop = min(n, start + _WINDOWS_PER_READ)
            t = {}
            for c in cols:
                t[c] = upgrade.column(f"activity/{c}", stop - start, t) if c in lacking else \
                    self._read_rows(f"activity/{c}", slice(start, stop), n)[1]
            packed = np.asarray(t["ever_positive"], dtype=np.uint8).reshape(stop - start, -1)
            bits = np.unpackbits(packed, axis=1, bitorder="little")
            if bits.shape[1] < n_bits:  # (sites seen after the table's width was set: never positive)
                bits = np.pad(bits, ((0, 0), (0, n_bits - bits.shape[1])))
            yield t, bits[:, :n_bits].view(bool)

    def dead_unit_windows(self, sites: pd.DataFrame, min_seen_share: float):
        """The dead-unit view that dead_relu judges and the report draws, for ``sites`` (rows of
        activity_sites): per activity window, oldest first, (step_start, step_end, judged per
        site: seen on at least ``min_seen_share`` of the window's watched steps, alive per unit of
        the sites in order (unit_layout): positive in the window and its site judged, and per
        site the share of its units never positive in the window)."""
        for starts, ends, judged, alive, share in self.dead_unit_blocks(sites, min_seen_share):
            for i in range(len(starts)):
                yield int(starts[i]), int(ends[i]), judged[i], alive[i], share[i]

    def dead_unit_blocks(self, sites: pd.DataFrame, min_seen_share: float):
        """dead_unit_windows a block of windows at a time, each a row of its arrays: (step_start,
        step_end, judged: windows x sites, alive: windows x units, share: windows x sites). One
        2-D pass a block: 20,000 windows of 25,600 units are 512M unit-windows."""
        site_of_unit, bounds = unit_layout(sites)
        offsets = sites["bit_offset"].to_numpy(dtype=np.int64)
        units = np.diff(bounds)
        bit_of_unit = np.concatenate([np.arange(o, o + u) for o, u in zip(offsets, units)] or [np.zeros(0, np.int64)])
        contiguous = bool(np.array_equal(bit_of_unit, np.arange(len(bit_of_unit))))  # the usual layout
        rows, n_units = sites.index.to_numpy(), len(bit_of_unit)
        nz = units > 0
        # Sites whose units fill whole bytes (the usual: 256 units) are counted on the packed
        # bits, 8 units a byte; the others unit by unit (reduceat: a site of no units sums nothing).
        by_bytes = contiguous and not (bounds % 8).any() and hasattr(np, "bitwise_count")  # (numpy 2)
        firsts = bounds[:-1][nz] // 8 if by_bytes else bounds[:-1][nz]
        for t, bits in self._activity_blocks():
            seen = np.asarray(t["steps_seen"]).reshape(len(bits), -1)
            watched = np.asarray(t["steps_watched"], dtype=np.int64)
            site_seen = np.where(rows < seen.shape[1], seen[:, np.minimum(rows, seen.shape[1] - 1)], 0) \
                if seen.shape[1] else np.zeros((len(bits), len(rows)))
            judged = (site_seen >= min_seen_share * watched[:, None]) & (watched > 0)[:, None]
            alive = bits[:, :n_units] if contiguous else bits[:, bit_of_unit]
            if not judged.all():
                alive = alive & np.repeat(judged, units, axis=1)
            count = np.zeros(judged.shape, dtype=np.int64)
            if len(firsts) and by_bytes:
                packed = np.asarray(t["ever_positive"], dtype=np.uint8).reshape(len(bits), -1)[:, :n_units // 8]
                if packed.shape[1] < n_units // 8:  # (sites past the table's width: never positive)
                    packed = np.pad(packed, ((0, 0), (0, n_units // 8 - packed.shape[1])))
                count[:, nz] = np.add.reduceat(np.bitwise_count(packed), firsts, axis=1, dtype=np.int64) * judged[:, nz]
            elif len(firsts):
                count[:, nz] = np.add.reduceat(alive, firsts, axis=1, dtype=np.int64)
            with np.errstate(invalid="ignore", divide="ignore"):  # (a site of 0 units: NaN)
                share = 1.0 - count / units
            yield (np.asarray(t["step_start"], dtype=np.int64), np.asarray(t["step_end"], dtype=np.int64),
                   judged, alive, share)

    # Sites seen after a table's last row are not in it yet (a kill): their columns may lie past
    # its width by this much, no more.
    _SITE_MARGIN = 1 << 16

    def _site_extent(self, sites: pd.DataFrame, offset: str, count: str, table: str, per_column: int) -> int:
        """The columns (or bits) the sites of a table span, checked against the table's width so
        that a damaged offset or count cannot make a reader allocate what it says."""
        if not len(sites):
            return 0
        off = np.asarray(sites[offset], dtype=np.int64)
        cnt = np.asarray(sites[count], dtype=np.int64)
        extent = int((off + cnt).max()) if off.min() >= 0 and cnt.min() >= 0 else -1
        width = self._width_of(table) * per_column
        if extent < 0 or extent > width + self._SITE_MARGIN:
            raise TraceFormatError(f"{self.path}: the {table.split('/')[0]} sites' {offset} and {count} do not fit "
                                   f"{table} ({width:,} wide); the trace is damaged")
        return extent

    @cached_property
    def attention_sites(self) -> pd.DataFrame:
        """Attention call sites: module (name), source, call, heads, head_offset, first_step."""
        cols = ("module", "source", "call", "heads", "head_offset", "first_step")
        return self._sites("attention_sites", cols, "source")

    def attention_stat(self, stat: str) -> pd.DataFrame:
        """Sampled steps x heads ("module/h0", ...) for entropy, max_weight, sink_share; steps x
        sites (module names) for head_similarity and keys."""
        per_head = ("entropy", "max_weight", "sink_share")
        if stat not in per_head + ("head_similarity", "keys"):
            raise ValueError(f"unknown attention statistic {stat!r}")
        t = self._table("attention", ("step", stat))
        sites = self.attention_sites
        if stat in per_head:
            self._site_extent(sites, "head_offset", "heads", f"attention/{stat}", 1)
            cols = [f"{m}/h{h}" for m, n in zip(sites["module"], sites["heads"]) for h in range(int(n))]
        else:
            cols = [f"{m}#{c}" if c else m for m, c in zip(sites["module"], sites["call"])]
        data = np.asarray(t[stat], dtype=np.float64)
        data = data.reshape(len(t["step"]), -1) if data.size else np.zeros((len(t["step"]), 0))
        width = len(cols)
        if data.shape[1] < width:  # rows written before later sites were seen
            data = np.pad(data, ((0, 0), (0, width - data.shape[1])), constant_values=np.nan)
        return self._frame(data[:, :width], t["step"], cols, f"attention/{stat}")

    @cached_property
    def call_sites(self) -> pd.DataFrame:
        """The calls of modules called more than once in a step: module (name), module_index,
        call (0 the first), first_step. One row per call site, in the order first seen."""
        return self._sites("call_sites", ("module", "call", "first_step"))

    def call_stat(self, stat: str = "output_absmax", steps=None) -> pd.DataFrame:
        """Watched steps x call sites ("module#call", call 0 the first) for output_absmax (-1
        where the call did not run), mean, std or zero_frac (NaN but on activation steps): the
        per-call view of modules/output_absmax and activations/ for a module called more than
        once in a step (an nn.ReLU reused in a block, a shared layer, a cell looped over time).
        ``steps``: only the rows of these steps (the table has a row per watched step)."""
        if stat not in ("output_absmax", "mean", "std", "zero_frac"):
            raise ValueError(f"unknown call statistic {stat!r}")
        sites = self.call_sites
        cols = [f"{m}#{c}" for m, c in zip(sites["module"], sites["call"])]
        if not self._has("call_outputs"):
            return self._frame(np.zeros((0, len(cols))), np.zeros(0, np.int64), cols, f"call_outputs/{stat}")
        n = self._n_rows("call_outputs", ("step", stat))
        all_steps = self._read_rows("call_outputs/step", None, n)[1]
        rows = None if steps is None else np.flatnonzero(np.isin(all_steps, np.asarray(steps)))
        idx, data = self._read_rows(f"call_outputs/{stat}", rows, n)
        data = np.array(data, dtype=np.float64)  # (a copy: the reader's arrays are read-only)
        data = data.reshape(len(idx), -1) if data.size else np.zeros((len(idx), 0))
        width = len(cols)
        if data.shape[1] < width:  # rows written before later sites were seen
            data = np.pad(data, ((0, 0), (0, width - data.shape[1])), constant_values=np.nan)
        data, at = data[:, :width], np.asarray(all_steps[idx], dtype=np.int64)
        if stat == "output_absmax" and width:  # (a row before a site was seen is padded NaN: not run)
            data[at[:, None] < np.asarray(sites["first_step"], dtype=np.int64)[None, :]] = -1.0
        return self._frame(data, at, cols, f"call_outputs/{stat}")

    @cached_property
    def module_outputs(self) -> pd.DataFrame:
        """The shape and dtype of each module's first floating-point output: module (name),
        module_index, shape (str), dtype, grad_fn (the op that made it; "" if none or unknown)."""
        return self._sites("module_outputs", ("module", "shape", "dtype", "grad_fn"), "shape", "dtype", "grad_fn")


def unit_layout(sites: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(the site of each unit, bounds: site j's units are bounds[j]:bounds[j + 1]) of the units
    of ``sites`` concatenated: per-unit state is kept in flat arrays and every window is one
    vectorised update (a long run has tens of thousands of windows)."""
    units = sites["units"].to_numpy(dtype=np.int64)
    return np.repeat(np.arange(len(sites)), units), np.concatenate([[0], np.cumsum(units)])
