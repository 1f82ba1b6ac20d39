"""Whole-parameter figures of a sharded (FSDP2) run, from each rank's shard.

Under FSDP2 a parameter is a DTensor split across ranks; each rank's recorder measured its own
shard (recorder/distributed/sharding.py), and says into how many shards each parameter is split
(``params/shards``). Here each rank's per-parameter step tables are read as the whole
parameter's: for a parameter in c shards, over the R ranks that recorded it,

    norm  = sqrt(c * mean_r(norm_r ** 2))     (the shards partition it: c * mean = sum)
    absmax = max_r(absmax_r)
    NaN/Inf count = c * mean_r(count_r)

(mean times c rather than a sum: with a replicated mesh dimension as well, HSDP, each shard is
recorded by several ranks). A value not measured on some rank (-1) stays not measured; a rank
whose trace ends early leaves the later steps as the shard's own. The per-shard figures stay in
``Trace.attempts``. Update ratios are each shard's (an estimate of the whole's).
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from .rank import RankTrace

_HOW = {"params/grad_norm": "l2", "params/param_norm": "l2", "params/grad_absmax": "max",
        "params/grad_nonfinite": "count"}


def combine(ranks: dict[int, RankTrace]) -> dict[int, RankTrace]:
    """The ranks, each read as whole parameters where any parameter is sharded."""
    sharded = {r: rt for r, rt in ranks.items() if (rt.param_shards > 1).any()}
    if not sharded:
        return ranks
    out = dict(ranks)
    for r, rt in sharded.items():
        peers = [p for q, p in sorted(ranks.items()) if q != r and p.param_names == rt.param_names
                 and np.array_equal(p.param_shards, rt.param_shards)]
        if peers:
            out[r] = WholeParams(rt, peers)
    return out


class WholeParams(RankTrace):
    """A rank's trace whose per-parameter step tables are the whole parameters' (see above)."""

    def __init__(self, own: RankTrace, peers: list[RankTrace]):
        self.__dict__.update({k: v for k, v in vars(own).items()
                              if not isinstance(getattr(type(own), k, None), cached_property)})
        self._own, self._peers = own, peers
        self._sharded_cols = np.flatnonzero(own.param_shards > 1)
        self.meta = {**own.meta, "shards_combined_over_ranks": 1 + len(peers)}

    def __getattr__(self, name):  # what the rank's own class knows (a timeline's attempts)
        if name.startswith("__") or name in ("_own", "_peers"):
            raise AttributeError(name)
        return getattr(self._own, name)

    # (read through the rank's own trace: a timeline stitches its attempts there)
    def _read(self, name, rows=None, text=False, ndim=None):
        return self._own._read(name, rows, text, ndim)

    def _step_column(self, col):
        return self._own._step_column(col)

    def _sampled_steps(self, table, cols):
        return self._own._sampled_steps(table, cols)

    @cached_property
    def step_index(self) -> np.ndarray:
        return self._own.step_index

    def _read_rows(self, name: str, rows, n: int):
        idx, data = self._own._read_rows(name, rows, n)
        how = _HOW.get(name)
        if how is None or not self._sharded_cols.size:
            return idx, data
        return idx, self._whole(name, how, idx, data)

    def blocks(self, name: str, stop: int | None = None, start: int = 0):
        how = _HOW.get(name)
        for a, block in self._own.blocks(name, stop, start):
            if how is not None and self._sharded_cols.size:
                block = self._whole(name, how, np.arange(a, a + len(block)), block)
            yield a, block

    def _whole(self, name: str, how: str, idx: np.ndarray, data: np.ndarray) -> np.ndarray:
        cols = self._sharded_cols
        mine = self._own.step_index
        parts = [data[:, cols].astype(np.float64)]
        rows_ok = np.ones(len(idx), dtype=bool)
        for peer in self._peers:
            # The peer's rows of the same step numbers (ranks step together; one that ended
            # early has fewer).
            steps = mine[idx] if len(idx) else np.zeros(0, np.int64)
            pos = np.searchsorted(peer.step_index, steps)
            pos = np.minimum(pos, max(len(peer.step_index) - 1, 0))
            have = (pos < len(peer.step_index)) & (peer.step_index[pos] == steps) if len(peer.step_index) else \
                np.zeros(len(idx), dtype=bool)
            vals = np.full((len(idx), cols.size), np.nan)
            if have.any():
                want = np.unique(pos[have])
                got_idx, got = peer._read_rows(name, want, peer.n_steps)
                vals[have] = got[np.searchsorted(got_idx, pos[have])][:, cols]
            parts.append(vals)
            rows_ok &= have
        stack = np.stack(parts)  # ranks x rows x sharded columns
        c = self._own.param_shards[cols].astype(np.float64)
        unmeasured = (stack < 0).any(axis=0)
        if how == "l2":
            whole = np.sqrt(c * np.mean(stack ** 2, axis=0))
        elif how == "max":
            whole = np.max(stack, axis=0)
        else:
            whole = np.rint(c * np.mean(stack, axis=0))
        whole[unmeasured] = -1
        out = np.array(data, copy=True)
        keep = rows_ok[:, None] & np.ones(cols.size, dtype=bool)
        sub = out[:, cols]
        sub[keep] = whole[keep].astype(out.dtype) if out.dtype.kind != "f" else whole[keep]
        out[:, cols] = sub
        out.flags.writeable = False
        return out
