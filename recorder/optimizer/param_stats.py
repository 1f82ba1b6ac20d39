"""Per-parameter statistics of a recorded step: gradient norms (every step), max |g| and weight
norms (watched steps, and every bad step), exact NaN/Inf counts, the sampled update ratios
||w_before - w_after|| / ||w_before||, and the weight and gradient histograms.

A step goes in two halves around its one transfer to the host (stats.Packer): ``pack`` adds the
device-side reductions, ``finish`` turns the host values into the step's rows. A bad step
(``measure_bad``) pays a second transfer, on that step only.
"""

from __future__ import annotations

import numpy as np
import torch

from ..distributed import sharding
from ..probe import Probe, StepPlan
from ..reductions.histograms import N_BINS, histogram
from ..reductions.stats import Packer, l2_norms
from .grad_norms import GradientNorms, add_grad_absmax, exact_overflowed_norms


class ParamStats(Probe):
    def __init__(self, params: list, grad_of, norms: GradientNorms, planner, hist_params: list[int]):
        self._params = params
        self._grad_of = grad_of
        # FSDP2: each rank's shard (distributed/sharding.py)
        self._sharded = any(map(sharding.is_sharded, params))
        self.norms = norms
        self.planner = planner
        self.hist_params = hist_params  # parameters whose histograms are taken (an even spread)
        self.bad_histograms_taken = False  # the first bad step's (bad_step_histograms)
        self.unmeasured = np.full(len(params), -1.0)  # the "not measured" row, shared, read-only
        self.no_bad_grads = np.zeros(len(params), dtype=np.int64)
        self.unmeasured.flags.writeable = self.no_bad_grads.flags.writeable = False
        # The weights as they were one step before a sampled update ratio, in buffers allocated
        # once (a fresh 8 MB copy every 10 steps page-faulted: 2.7 ms on the MLP, measured).
        self._w_buf: list[torch.Tensor] = []
        self._prev_weights = self._copy_weights() if params else None
        self._prev_norm = None  # ||_prev_weights|| per tensor, when measured as they were taken
        self._s: tuple | None = None  # this step's state between pack and finish

    def pack(self, pk: Packer, plan: StepPlan) -> None:
        """The step's device-side reductions, into ``pk`` (call under torch.no_grad())."""
        step, watched, histograms = plan.step, plan.watched, plan.histograms
        grads = list(map(self._grad_of, self._params))
        has = [i for i, g in enumerate(grads) if g is not None and not g.is_sparse]
        present = [grads[i] for i in has]
        # float32 norms (a float64 accumulation costs 13x on CPU, measured); a finite norm
        # above float32's range shows as Inf and is recomputed in float64 in finish().
        cached = None  # the norms the optimizer step pre-hook computed, if it saw every gradient
        if present:
            seen = self.norms.cached()
            if seen is not None:
                cached = np.array([seen[i] for i in has])
            else:
                pk.add("grad_norm", l2_norms(present))
            if watched:
                add_grad_absmax(pk, present, self.norms.fused_option)
        else:  # no gradient now: the ones the step's update used, if cleared since (grad_norms.cached)
            seen = self.norms.cached()
            cached = np.asarray(seen, dtype=np.float64) if seen is not None else None
        # Weight norms on watched steps, and on the step before an update ratio (its
        # ||w_before||); other steps write -1 (not measured) unless they go bad.
        plan = self.planner
        if step == plan.next_update:  # a sample: plan the next now, its copy may be due at once
            plan.sample_update(step)
        measure_w = watched or step + 1 == plan.next_update
        do_update = self._prev_weights is not None and step == plan.sampled_step
        update_den = None
        weights = self.weights() if measure_w or do_update else None
        if weights:
            if measure_w:
                pk.add("param_norm", l2_norms(weights))
            # The model may have moved (model.to(device), .half()) since the copy was taken.
            do_update = (do_update and self._prev_weights[0].device == weights[0].device
                         and self._prev_weights[0].dtype == weights[0].dtype)
            if do_update:
                update_den = self._prev_norm
                if update_den is None:  # (the copy taken at the start)
                    pk.add("update_den", l2_norms(self._prev_weights))
                # In place: the buffers become w_before - w_after.
                torch._foreach_sub_(self._prev_weights, weights)
                pk.add("update_num", l2_norms(self._prev_weights))
        hist = histograms and bool(self.hist_params)
        if hist:
            self._add_histograms(pk, grads)
        self._s = (has, present, cached, weights, update_den, hist)

    def _add_histograms(self, pk: Packer, grads: list) -> None:
        pk.add("hist_w", [histogram(sharding.local(self._params[i])) for i in self.hist_params])
        pk.add("hist_g", [histogram(grads[i]) if grads[i] is not None and not grads[i].is_sparse
                          else torch.full((N_BINS,), -1, dtype=torch.long, device=self._params[i].device)
                          for i in self.hist_params])

    def bad_step_histograms(self, host: dict) -> bool:
        """The first bad step's weight and gradient histograms, if it was not a histogram step:
        how many of each tensor's values went NaN/Inf, and how large the rest were, at the step
        the black box fires (a second transfer, once a run; call under no_grad())."""
        if self.bad_histograms_taken or not self.hist_params or self._s[5]:
            return False
        self.bad_histograms_taken = True
        extra = Packer()
        self._add_histograms(extra, list(map(self._grad_of, self._params)))
        host.update(extra.fetch())
        self._s = self._s[:5] + (True,)
        return True

    def grads_nonfinite(self, host: dict) -> bool:
        """After the transfer: whether a gradient norm is NaN/Inf (the pre-hook's norms, if it
        took them, are put in ``host``)."""
        has, present, cached = self._s[:3]
        if cached is not None:
            host["grad_norm"] = cached
        return bool(present) and not np.isfinite(host["grad_norm"]).all()

    def measure_bad(self, host: dict) -> None:
        """A bad step not watched is measured in full: max |g| and weight norms, a second transfer."""
        has, present, cached, weights, update_den, hist = self._s
        extra = Packer()
        if present:
            add_grad_absmax(extra, present, self.norms.fused_option)
        if self._params and "param_norm" not in host:
            weights = self.weights()
            extra.add("param_norm", l2_norms(weights))
            self._s = (has, present, cached, weights, update_den, hist)
        host.update(extra.fetch())

    def finish(self, host: dict, step: int, full: bool) -> tuple[dict, np.ndarray]:
        """The step's params/ row (float64 and int64: the writer stores float32/int32) and its
        exact NaN/Inf gradient counts; ``full``: a watched or bad step, max |g| measured. Takes
        the weights the next sampled update will be compared against (call under no_grad())."""
        has, present, cached, weights, _, _ = self._s
        n_params = len(self._params)
        grad_norm = None if present and len(has) == n_params else np.full(n_params, np.nan)
        if not present and cached is not None:
            grad_norm = cached
        grad_absmax = np.full(n_params, np.nan) if full else None  # None: not measured
        grad_bad = self.no_bad_grads  # exact NaN/Inf element counts (a shared row of zeros)
        if present:
            g_norm = host["grad_norm"]
            g_absmax = host.get("grad_absmax")
            if full:
                # Only a non-finite max|g| (or norm: a float32 norm may also overflow) can
                # hide a NaN/Inf.
                bad = np.flatnonzero(~np.isfinite(g_norm if g_absmax is None else g_absmax)).tolist()
                if bad:  # rare: count exactly, at the cost of another transfer on this step only
                    counts = torch.stack([(~torch.isfinite(present[j])).sum() for j in bad]).cpu().numpy()
                    grad_bad = np.zeros(n_params, dtype=np.int64)
                    grad_bad[[has[j] for j in bad]] = counts
                g_norm = exact_overflowed_norms(g_norm, g_absmax, present)
            if len(has) == n_params:
                grad_norm = g_norm
            else:
                grad_norm[has] = g_norm
            if g_absmax is not None:
                grad_absmax[has] = g_absmax
        param_norm = exact_overflowed_norms(host["param_norm"], None, weights) if "param_norm" in host else None
        # Weights to compare the next sampled update against: taken after this update, with
        # their norms (measured on this step: ||w_before|| of the next).
        plan = self.planner
        if self._params and step + 1 == plan.next_update:
            self._prev_weights = self._copy_weights()
            self._prev_norm = param_norm
        elif self._params and step == plan.sampled_step:
            self._prev_weights = self._prev_norm = None
        row = {"grad_norm": grad_norm,
               "grad_absmax": self.unmeasured if grad_absmax is None else grad_absmax,
               "grad_nonfinite": grad_bad,
               "param_norm": self.unmeasured if param_norm is None else param_norm}
        return row, grad_bad

    def extra_rows(self, host: dict, step: int, hist_act) -> dict:
        """The step's sampled update ratios and histograms (``hist_act``: the modules' output
        histograms, or None on a step without histograms), as rows."""
        rows = {}
        update_den, hist = self._s[4], self._s[5]
        if "update_num" in host:
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = host["update_num"] / (host["update_den"] if "update_den" in host else update_den)
            rows["updates"] = {"step": step, "ratio": ratio}
        if hist_act is not None:
            nh = len(self.hist_params)
            w = host["hist_w"].reshape(nh, N_BINS) if hist else np.zeros((0, N_BINS))
            g = host["hist_g"].reshape(nh, N_BINS) if hist else np.zeros((0, N_BINS))
            rows["histograms"] = {"step": step, **{k: np.minimum(v, 2**31 - 1).astype(np.int32).reshape(-1)
                                                    for k, v in (("weight", w), ("grad", g), ("activation", hist_act))}}
        self._s = None
        return rows

    def weights(self) -> list[torch.Tensor]:
        """The parameters (each rank's shard of a sharded one), to read under no_grad, never to write."""
        if self._sharded:
            return [sharding.local(p.detach()) for p in self._params]
        return self._params  # (callers read them under no_grad: no detach, an op each, needed)

    def _copy_weights(self) -> list[torch.Tensor]:
        """The weights now, copied into _w_buf (allocated again only if the model moved)."""
        with torch.no_grad():
            weights = self.weights()
            buf = self._w_buf
            if len(buf) != len(weights) or any(b.shape != w.shape or b.dtype != w.dtype or b.device != w.device
                                               for b, w in zip(buf, weights)):
                self._w_buf = buf = [torch.empty_like(w) for w in weights]
            torch._foreach_copy_(buf, weights)
            return buf

    def release(self) -> None:
        """Drop the weight copies (at close)."""
        self._prev_weights = None
        self._w_buf = []

    def close(self) -> None:
        self.release()
