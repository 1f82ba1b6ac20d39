"""The step planner alone, without torch: which steps are watched, histogrammed and sampled for
update ratios, and how the budgets space them, on a clock the test drives. Run in a process
where torch cannot be imported, as the planner must need none."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys
    sys.modules["torch"] = None  # importing torch would fail
    import importlib.util, os
    spec = importlib.util.spec_from_file_location("planner", os.path.join(sys.argv[1], "recorder", "planner.py"))
    planner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(planner)
    from types import SimpleNamespace

    cfg = SimpleNamespace(activations_every=10, attention_every=10, activity_window=50, watch_budget=0.003,
                          watch_warmup=100, histogram_every=100, histogram_budget=0.001,
                          update_ratio_every=10, update_ratio_budget=0.0015, census_every=50, census_budget=0.0015)

    def run(steps, plain_s, watched_extra_s, jump_at=None):
        p = planner.StepPlanner(cfg)
        t, watched = 0.0, []
        for step in range(steps):
            w = step >= p.next_watch
            h = step == p.next_hist
            if step == p.next_update:
                p.sample_update(step)
            t += plain_s + (watched_extra_s if w else 0.0)
            p.saw(step, 10.0 if step == jump_at else 1.0, 1e-3)
            p.after_step(step, w or h, w, h, now=t)
            if w:
                watched.append(step)
        return p, watched

    # Warm-up: every 10th step for the first 100; then a watched step costing 3 plain steps
    # (0.3% budget: 1000 plain steps' worth) is spaced to the longest gap the activity window
    # allows, 50 steps.
    p, watched = run(400, 0.01, 0.03)
    assert watched[:10] == list(range(0, 100, 10)), watched
    assert watched[10:14] == [100, 150, 200, 250], watched
    # A cheap watched step (1% of a plain one): every 10th step throughout.
    p, watched = run(300, 0.01, 0.0001)
    assert watched == list(range(0, 300, 10)), watched
    # A loss jump at step 203 (after 20 losses): the next step is watched, then 4 more 10 apart,
    # then the budget's 50 again.
    p, watched = run(400, 0.01, 0.03, jump_at=203)
    assert [s for s in watched if 200 <= s < 300] == [200, 204, 214, 224, 234, 244, 294], watched
    # The census: 45 ms against a 10 ms plain step and a 0.15% budget: every ~3,000 steps.
    assert p.census_gap(0.045) == 3001, p.census_gap(0.045)
    assert planner.StepPlanner.gap(1.0, 0.1, 3, 30) == 12
    print("ok")
""")


def test_planner_spaces_samples_by_their_budgets_without_torch():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", SCRIPT, root], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
