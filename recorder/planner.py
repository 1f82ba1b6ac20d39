"""Which step records what, and what it may cost: the plan of watched steps, histograms, update
ratios and censuses, each kept within its share of the training time (the config's budgets).

Plain Python and floats only (no torch): it runs after every step, and it is tested alone.
The recorder tells it what each step was (``after_step``) and reads back what comes next
(``next_watch``, ``next_hist``, ``next_update``).
"""

from __future__ import annotations

import collections
import math
import time


class StepPlanner:
    def __init__(self, config):
        self.config = config
        self.next_watch = 0  # the next step whose modules are all hooked
        self.next_hist = 0  # the next histogram step
        # The next sampled update ratio; its weights are copied one step before. The last
        # sampled step, and how long the step before it took.
        self.next_update = 0
        self.sampled_step = -1
        self.jumps = Jumps()  # a sudden jump of the loss or lr: the next watches come densely
        self.jumped = False  # this step jumped (set by saw(), used by after_step())
        self._burst = 0  # watched steps still to take at the base gap after a jump
        self._t_last_step: float | None = None
        self._t_before_update: float | None = None
        self._plain_s: collections.deque = collections.deque(maxlen=21)  # recent plain step times
        self._update_extra: collections.deque = collections.deque(maxlen=5)  # recent samples' cost

    def align(self, s: int) -> None:
        """Schedules that count from step 0 start from step s (a resumed attempt); the first
        update ratio at s + 1, against a copy taken at the end of step s."""
        self.next_watch = self.next_hist = s
        self.next_update = s + 1

    def sample_update(self, step: int) -> None:
        """This step is a sampled update ratio: plan the next now (its copy may be due at once)."""
        self.sampled_step = step
        self.next_update = step + self.update_gap(step)

    def saw(self, step: int, loss: float, lr: float) -> None:
        """The step's loss and learning rate (a jump of either brings dense watched steps)."""
        self.jumped = self.jumps.seen(step, loss, lr)

    def after_step(self, step: int, watched: bool, activations: bool, histograms: bool,
                   now: float | None = None) -> None:
        """After a step: time it; after a watched step choose the next one (watch_budget), after a
        histogram step the next one (histogram_budget), and after a sampled update ratio note
        what its two steps cost. ``activations``/``histograms``: what the step sampled."""
        now = time.perf_counter() if now is None else now
        took = now - self._t_last_step if self._t_last_step is not None else None
        self._t_last_step = now
        sampled = step == self.sampled_step
        if sampled:
            # Its two steps over plain ones (a watched sampled step counts as twice the step
            # before it, whose copy and norms it matches).
            before = self._t_before_update
            plain = self.plain_step_s()
            if before is not None and took is not None and plain is not None:
                self._update_extra.append(2 * (before - plain) if activations
                                          else (before - plain) + (took - plain))
            self._t_before_update = None
        if step + 1 == self.next_update:
            self._t_before_update = took
        elif not (watched or sampled) and took is not None:  # (watched: histograms, samples too)
            self._plain_s.append(took)
        if histograms or activations:
            cfg = self.config
            plain = self.plain_step_s()
            over = took - plain if took is not None and plain is not None else None  # this step's extra
            if histograms:
                every = cfg.histogram_every
                self.next_hist = step + self._budget_gap(step, over, plain, cfg.histogram_budget, every, 10 * every)
            if activations:
                base = min(cfg.activations_every, cfg.attention_every)
                # At most one activity window apart: every window (dead units) and every stretch
                # of 50 steps (attention, activations) keeps a sample, even on a tiny model.
                self.next_watch = step + self._budget_gap(step, over, plain, cfg.watch_budget, base,
                                                          max(base, -(-cfg.activity_window // base) * base))
                if self._burst:
                    self.next_watch, self._burst = step + base, self._burst - 1
        if self.jumped:  # watch the next step, then 4 more at the base gap (40 steps on)
            self.next_watch, self._burst, self.jumped = step + 1, 4, False

    def plain_step_s(self) -> float | None:
        """Median time of the recent plain steps (neither watched nor part of an update-ratio
        sample), or None before there are three. Sorted only where needed (watched and sampled
        steps), not on the plain steps, which are most of them."""
        n = len(self._plain_s)
        return sorted(self._plain_s)[n // 2] if n >= 3 else None

    def update_gap(self, step: int) -> int:
        """Steps from this sampled update ratio to the next, at the median cost of the last few
        samples (one step can be slowed by anything: a census, the OS)."""
        every, extra = self.config.update_ratio_every, self._update_extra
        return self._budget_gap(step, sorted(extra)[len(extra) // 2] if extra else None, self.plain_step_s(),
                                self.config.update_ratio_budget, every, 10 * every)

    def census_gap(self, cost: float) -> int:
        """Steps to the next scheduled census, one having cost ``cost`` seconds: census_every, or
        more to keep it within census_budget of the median plain step (not the mean time between
        steps: an evaluation pass or a checkpoint between steps would make censuses more frequent)."""
        gap, plain = self.config.census_every, self.plain_step_s()
        if plain is not None:
            gap = max(gap, int(cost / (self.config.census_budget * max(plain, 1e-9))) + 1)
        return gap

    def _budget_gap(self, step: int, extra: float | None, plain: float | None, budget: float,
                    base: int, most: int) -> int:
        """Steps to the next sample of a budgeted schedule (watched steps, histograms, update
        ratios): `base` in the warm-up (watch_warmup) or while a sample's `extra` seconds or the
        plain step's time are unknown; then the multiple of `base`, at most `most`, at which
        samples take at most `budget` of the training time."""
        if step + 1 < self.config.watch_warmup or extra is None or plain is None:
            return base
        return self.gap(extra, budget * plain, base, most)

    @staticmethod
    def gap(extra: float, allowed: float, base: int, most: int) -> int:
        """Steps to the next sample: the multiple of `base`, at most `most`, at which a sample
        costing `extra` seconds adds at most `allowed` seconds a step."""
        need = int(math.ceil(max(0.0, extra) / max(allowed, 1e-12)))
        return min(max(base, -(-need // base) * base), max(base, most))


class Jumps:
    """Sudden changes worth a closer look: the loss jumping above its recent level, or the
    learning rate rising 3x or more in one step (a scheduler bug, a warm-up restart; warm-up's
    own increments and decays do not). After one the recorder watches the next steps densely
    (StepPlanner.after_step), so that what follows it — attention collapsing, units dying — is dated to
    within a few steps instead of the sparse schedule's 50. At most one burst per `quiet` steps,
    so a noisy loss cannot make every step a watched one. Float arithmetic only: it runs on
    every plain step."""

    LOSS_JUMP = 3.0  # x the loss's moving average (over ~20 steps, once 20 losses were seen)
    LR_JUMP = 3.0  # x the previous step's learning rate
    QUIET = 200  # steps between bursts, at least

    def __init__(self):
        self._loss_avg = math.nan
        self._losses = 0
        self._lr = math.nan
        self._last = -self.QUIET

    def seen(self, step: int, loss: float, lr: float) -> bool:
        """Whether this step jumped (and no burst was started in the last QUIET steps)."""
        avg, prev_lr = self._loss_avg, self._lr
        jumped = (self._losses >= 20 and avg > 0 and loss > self.LOSS_JUMP * avg) or (
            prev_lr > 0 and lr > self.LR_JUMP * prev_lr)
        if loss == loss and abs(loss) != math.inf:  # (not NaN/Inf: a bad step is measured in full anyway)
            self._loss_avg = loss if avg != avg else avg + 0.05 * (loss - avg)
            self._losses += 1
        self._lr = lr
        if jumped and step - self._last >= self.QUIET:
            self._last = step
            return True
        return False
