"""loss_divergence: the loss rises far above its best value and stays there, or blows up to Inf/NaN.

Heuristic: smooth the loss with a trailing median over `window` steps (the first full window is
the warm-up) and keep its running minimum, the best loss so far. The loss is "up" at a step
where the smoothed loss is
  - at least `rise_ratio` x that best (skipped when the best is <= 0: log-likelihoods), and
  - has undone at least `min_progress_lost` of the progress made since the first window
    ((now - best) / (start - best)), so a loss near zero doubling from 1e-3 to 2e-3 is quiet, and
  - has risen by at least `min_rise_in_noise` x the per-step noise of the loss (1.4826 x the
    median absolute deviation of the loss from its trailing median), so that the lowest of many
    noisy medians is not taken for the level the run had reached.
Verdicts:
  - the loss goes NaN or +Inf while it is up, or right after a finite loss that was itself up
    (a blow-up faster than the window): error;
  - it is still up at the end of the run: warning; error when it ends `error_ratio` x above its
    best and above where it started (worse than the untrained model);
  - it came back down before the end: nothing (a spike the run recovered from is not a
    divergence); a loss that jumps straight from normal values to NaN/Inf is a numerical fault,
    which the ``nonfinite`` detector reports with its birthplace;
  - a blow-up in the first two windows, which the rule above takes for the run's start: a 5-step
    median of the loss at 3x the first step's loss (the model before any update)
    and above the noise: warning, recovered or not (a learning rate too high from the start).
The step named is the first step, within the window that crossed, whose own loss was up and
from which most losses up to the crossing were.

Sources: the trailing-median / running-minimum test is the usual "the loss went up and stayed
up" check; the thresholds were measured on the sample traces and on simulated noisy losses
(chi-square, exponential and log-normal per-step noise: no false warning), see
LossDivergenceConfig.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..findings import Finding
from ..series import trailing_median
from ..trace import RankTrace
from ..trace.losses import loss_series
from ._schedule import LrEvidence, lr_context
from ._thresholds import check_bounds as _check


@dataclass(frozen=True)
class LossDivergenceConfig:
    # Trailing median over this many steps smooths batch-to-batch noise before comparing losses;
    # the first full window is the warm-up (no verdict before it). 20: with 10, the lowest of the
    # medians of a very noisy loss (batch of 1, chi-square noise) sits 3x below its typical
    # level (simulated); with 20 and the noise test below no simulated noisy run is flagged.
    window: int = 20
    # Diverged: the smoothed loss rises above this many times its best (lowest smoothed) value so
    # far. healthy_mlp's never exceeds 1.2x its running minimum (measured); a language model that
    # diverges climbs from ~2.5-3.5 towards ln(vocab) ~ 10.8, i.e. 3-4x.
    rise_ratio: float = 2.0
    # ... and that rise undoes at least this share of the progress made since the first window
    # ((now - best) / (start - best)), so a loss near zero doubling from 1e-3 to 2e-3 stays quiet.
    # 0.25: healthy_mlp's worst bump undoes 2% (measured).
    min_progress_lost: float = 0.25
    # ... and exceeds this many times the per-step noise of the loss (1.4826 x the median
    # absolute deviation from the trailing median). 2.5: no false warning on 20 simulated flat or
    # decaying runs each of chi-square(1), exponential and log-normal(sigma 2) noise, 100 to
    # 20,000 steps; a 3x rise under 30% noise is always caught (simulated).
    min_rise_in_noise: float = 2.5
    # Still up at the end of the run: an error (rather than a warning) when the smoothed loss ends
    # this many times above its best and above where it started: worse than the untrained model.
    error_ratio: float = 100.0

    def __post_init__(self):
        _check(self, window=(2, None), rise_ratio=(1.0, None), min_progress_lost=(0.0, None),
               min_rise_in_noise=(0.0, None), error_ratio=(1.0, None))


class Evidence(LrEvidence, total=False):
    best_smoothed_loss: float  # the lowest smoothed loss (trailing median) up to the crossing
    best_step: int  # ... its step
    loss_at_step: float  # the loss at the finding's step
    ratio_to_best: float  # ... over the best (None: best <= 0)
    start_smoothed_loss: float  # the smoothed loss of the first full window
    loss_noise: float  # per-step noise of the loss: 1.4826 x its median absolute deviation
    last_finite_loss: float  # the last finite loss before a NaN/Inf (or of the run)
    last_finite_loss_step: int  # ... its step
    final_smoothed_loss: float  # the smoothed loss at the end of the judged stretch
    first_nonfinite_loss_step: int  # the step the loss went NaN/+Inf (None: it did not)
    window_steps: int  # the trailing median's window (steps)
    threshold_rise_ratio: float  # rise over the best that counts (rise_ratio of the config)
    threshold_progress_lost: float  # share of the progress undone that counts (min_progress_lost)
    steps: int  # no loss was given (no_loss): how many steps the trace holds
    early_peak_smoothed_loss: float  # a blow-up in the first steps: the highest EARLY-step median
    early_peak_step: int  # ... its step


KIND = "loss_divergence"
REQUIRES = ("steps/loss",)
CONFIG = LossDivergenceConfig  # its thresholds: a [loss_divergence] table of analyze --config
ORDER = 110  # among findings of one step and stage, the detectors run (and list) in this order

ADVICE = (
    "Lower the learning rate (3-10x) or lengthen its warm-up, and clip the gradient norm "
    "(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)); restart from a checkpoint taken "
    "before the step named. With Adam on large models, loss spikes often calm down with a lower "
    "beta2 (0.95) or a larger eps; under fp16, use a GradScaler or bf16. If the data changed at "
    "that step (a new shard, a corrupt batch), check it."
)

_NO_LOSS_ADVICE = ("Pass the loss to the recorder: rec.step(loss=loss), once per iteration after "
                   "optimizer.step().")


def no_loss(rt: RankTrace, kind: str) -> list[Finding]:
    """[info finding] if the trace has steps but no loss was ever passed to rec.step(), else []."""
    if rt.n_steps == 0:
        return []
    loss = rt.columns["loss"].to_numpy()
    if not np.isnan(loss).all():
        return []
    return [Finding(kind, "info", None, [],
                    f"{kind} not checked: rec.step() was not given the loss in any of the "
                    f"{rt.n_steps:,} steps (or it was NaN from the first step).",
                    {"steps": rt.n_steps}, _NO_LOSS_ADVICE)]


def detect(rt: RankTrace, cfg: LossDivergenceConfig) -> list[Finding]:
    missing = no_loss(rt, KIND)
    if missing:
        return missing
    loss, nonfinite = loss_series(rt)
    w = cfg.window
    # The stretch before the first NaN/Inf loss is judged; -Inf (a log-likelihood collapsing)
    # ends it too but never counts as a blow-up.
    bad = np.flatnonzero(nonfinite)
    end = int(bad[0]) if bad.size else len(loss)
    if end < w + 1:
        return []  # (too short to judge, even a blow-up in its first steps)
    tm = trailing_median(loss[:end], w)
    tm[: w - 1] = np.nan  # warm-up: only full windows
    judged = np.flatnonzero(~np.isnan(tm))
    finite = np.flatnonzero(np.isfinite(loss[:end]))
    if judged.size < 2 or finite.size < w:
        return []
    with np.errstate(invalid="ignore"):
        noise = _NORMAL_MAD * float(np.nanmedian(np.abs(loss[w - 1:end] - tm[w - 1:end])))
    ref = _Reference(start=float(tm[judged[0]]), noise=noise,
                     best=np.fmin.accumulate(np.where(np.isnan(tm), np.inf, tm)))
    up = ref.is_up(tm, cfg)
    regions = _regions(up)
    reaches_end = bool(regions) and regions[-1][1] == end

    if bad.size and not np.isneginf(loss[end]):
        # Up when it blew up: the smoothed loss was, or the last finite loss itself was (a
        # blow-up faster than the window). Otherwise a sudden NaN/Inf: nonfinite's business.
        j = int(finite[-1])
        last_up = bool(ref.is_up(loss[j:j + 1], cfg, at=j)[0])
        if reaches_end or last_up:
            cross = regions[-1][0] if reaches_end else end - 1
            return [_finding(rt, cfg, "error", cross, loss, tm, ref, end)]
    if not reaches_end:
        early = _early_rise(rt, cfg, loss[:end], tm, noise)
        return [early] if early is not None else []  # never up, or came back down: not a divergence
    final = tm[end - 1]
    best = ref.best[end - 1]
    worse = final >= cfg.error_ratio * best > 0 and final > ref.start
    return [_finding(rt, cfg, "error" if worse else "warning", regions[-1][0], loss, tm, ref, None)]


def _early_rise(rt, cfg, loss: np.ndarray, tm: np.ndarray, noise: float) -> Finding | None:
    """A blow-up inside the first window, which the rule above takes for the run's start: within
    the first 2 windows, the EARLY-step trailing median of the loss at EARLY_RATIO x the first
    step's loss (the model before any update) or more, and min_rise_in_noise x the noise above
    it. Reported whether or not the loss came back down: a learning rate too high from the start
    (nanoGPT at lr 10: 6.9 -> 1,033 -> 14.6 within 20 steps)."""
    first = float(loss[0])
    n = min(len(loss), 2 * cfg.window)
    if not (np.isfinite(first) and first > 0) or n < EARLY:
        return None
    short = trailing_median(loss[:n], EARLY)
    short[:EARLY - 1] = np.nan
    with np.errstate(invalid="ignore"):
        up = (short >= EARLY_RATIO * first) & (short - first >= cfg.min_rise_in_noise * noise)
    if not up.any():
        return None
    cross = int(np.flatnonzero(up)[0])
    raw = np.flatnonzero(loss[:cross + 1] >= EARLY_RATIO * first)
    onset = int(raw[0]) if raw.size else cross
    peak = int(np.nanargmax(np.where(up, short, -np.inf)))
    steps = rt.step_index
    final = float(tm[len(loss) - 1]) if np.isfinite(tm[len(loss) - 1]) else float(loss[-1])
    ev = {"best_smoothed_loss": first, "best_step": int(steps[0]), "loss_at_step": float(loss[onset]),
          "ratio_to_best": float(loss[onset] / first), "start_smoothed_loss": first, "loss_noise": noise,
          "last_finite_loss": float(loss[-1]), "last_finite_loss_step": int(steps[len(loss) - 1]),
          "final_smoothed_loss": final, "first_nonfinite_loss_step": None, "window_steps": EARLY,
          "early_peak_smoothed_loss": float(short[peak]), "early_peak_step": int(steps[peak]),
          "threshold_rise_ratio": cfg.rise_ratio, "threshold_progress_lost": cfg.min_progress_lost}
    after = ("and came back below it" if final < EARLY_RATIO * first else "and stayed up") + \
        f": {final:.4g} over the last {cfg.window} steps" + (", worse than at the start" if final > first else "")
    summary = (f"The loss blew up in its first steps: from {first:.4g} at step {int(steps[0])} to {loss[onset]:.4g} "
               f"at step {int(steps[onset])}, a {EARLY}-step median of {short[peak]:.4g} ({short[peak] / first:.3g}x) at "
               f"step {int(steps[peak])}, {after}.")
    lr_evidence, lr_clause = lr_context(rt, onset)
    ev.update(lr_evidence)
    if lr_clause:
        summary = summary[:-1] + f". The rise began {lr_clause}."
    return Finding(KIND, "warning", int(steps[onset]), [], summary, ev, ADVICE)


# The first steps' blow-up is smoothed over this many steps (a median of 5: one bad batch is not it),
# and counts at this many times the first step's loss: a single batch's loss is the reference, and
# a healthy regression whose batches' losses scatter 40% about their level reached 2.3x (measured;
# tests/analyzer/test_activity_attention_memory.py's transformer); a learning rate 1000x too high
# reaches 12-100x.
EARLY, EARLY_RATIO = 5, 3.0
# 1.4826 x the median absolute deviation estimates the standard deviation of normal noise.
_NORMAL_MAD = 1.4826


class _Reference:
    """What a loss is judged against: the best smoothed loss so far, the first, and the noise."""

    def __init__(self, start: float, noise: float, best: np.ndarray):
        self.start, self.noise, self.best = start, noise, best

    def is_up(self, x: np.ndarray, cfg: LossDivergenceConfig, at: int | None = None) -> np.ndarray:
        """Where x (the smoothed loss, or raw losses judged at step index `at`) is diverged."""
        best = self.best if at is None else np.full(len(x), self.best[at])
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            progress = self.start - best
            lost = np.where(progress > 0, (x - best) / np.where(progress > 0, progress, 1.0), np.inf)
            # With a best <= 0 the ratio means nothing and the progress lost decides alone; a run
            # that made no progress at all, with a best <= 0, cannot be judged.
            ratio_ok = np.where(best > 0, x >= cfg.rise_ratio * best, True)
            judged = np.isfinite(best) & ((best > 0) | (progress > 0))
            above_noise = (x - best) >= cfg.min_rise_in_noise * self.noise
            return judged & ratio_ok & (lost >= cfg.min_progress_lost) & above_noise & (x > best)


def _regions(up: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) index pairs of the runs of True in up."""
    d = np.diff(np.concatenate([[0], up.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist()))


def _onset(loss, ref: _Reference, cfg, cross: int) -> int:
    """Where the rise shows first: within the window that crossed, the first step whose own loss
    was up (against the best at the crossing) and from which most losses up to the crossing were
    up (so a noisy batch or two earlier in the window does not date it)."""
    lo = max(cross - cfg.window + 1, 0)  # (a rise inside the warm-up window is dated where it began)
    raw = ref.is_up(loss[lo:cross + 1], cfg, at=cross)
    share = np.cumsum(raw[::-1])[::-1] / np.arange(len(raw), 0, -1)
    hits = np.flatnonzero(raw & (share > 0.5))
    return lo + int(hits[0]) if hits.size else cross


def _ratio(x: float, best: float) -> str:
    return f" ({x / best:.3g}x)" if best > 0 else ""


def _finding(rt, cfg, severity, cross, loss, tm, ref: _Reference, i_bad) -> Finding:
    steps = rt.step_index
    onset = _onset(loss, ref, cfg, cross)
    step = int(steps[onset])
    b = float(ref.best[cross])
    best_i = int(np.flatnonzero(tm[: cross + 1] == b)[0])
    end = i_bad if i_bad is not None else len(loss)
    j = int(np.flatnonzero(np.isfinite(loss[:end]))[-1])  # the last finite loss
    ev = {
        "best_smoothed_loss": b,
        "best_step": int(steps[best_i]),
        "loss_at_step": float(loss[onset]),
        "ratio_to_best": float(loss[onset] / b) if b > 0 else None,
        "start_smoothed_loss": ref.start,
        "loss_noise": ref.noise,
        "last_finite_loss": float(loss[j]),
        "last_finite_loss_step": int(steps[j]),
        "final_smoothed_loss": float(tm[end - 1]),
        "first_nonfinite_loss_step": int(steps[i_bad]) if i_bad is not None else None,
        "window_steps": cfg.window,
        "threshold_rise_ratio": cfg.rise_ratio,
        "threshold_progress_lost": cfg.min_progress_lost,
    }
    head = (f"The loss diverged from step {step}: {loss[onset]:.4g}{_ratio(loss[onset], b)} against "
            f"its best of {b:.4g} ({cfg.window}-step median, step {ev['best_step']})")
    if i_bad is not None:
        what = "Inf" if np.isposinf(loss[i_bad]) else "NaN"
        tail = (f"; it reached {loss[j]:.4g} at step {steps[j]} and went {what} at step "
                f"{ev['first_nonfinite_loss_step']}.")
    else:
        final = float(tm[end - 1])
        worse = ", worse than at the start" if final > ref.start else ""
        tail = (f", and stayed up: {final:.4g}{_ratio(final, b)} over the last {cfg.window} "
                f"steps{worse}.")
    lr_evidence, lr_clause = lr_context(rt, onset)
    ev.update(lr_evidence)
    if lr_clause:
        tail = tail + f" The rise began {lr_clause}."
    return Finding(KIND, severity, step, [], head + tail, ev, ADVICE)
