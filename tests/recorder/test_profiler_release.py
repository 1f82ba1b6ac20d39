"""Issue 38 (7): a profiler window's results are freed once the writer has exported them, at the
next step boundary, not whenever a full GC finds them (torch.profiler.profile holds its own bound
methods). Left on glibc's heap, those small blocks (~5 MB for the CNN of benchmarks/allocator.py)
cut the free heap into pieces smaller than an activation, and every later step paged its
activations in again (benchmarks/README.md, "glibc's malloc")."""

import gc
import weakref

import pytest
import torch

from torchautopsy import Recorder


@pytest.mark.slow  # ~9 s on two loaded cores: the profiler's first start
def test_window_results_freed_without_gc(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    rec = Recorder(model, str(tmp_path / "run"), profile_first=2, profile_steps=1)
    results = None
    was_enabled = gc.isenabled()
    gc.disable()  # only reference counting may free them
    try:
        for step in range(6):
            if rec.profiler.prof is not None and results is None:
                results = weakref.ref(rec.profiler.prof.profiler)
            opt.zero_grad(set_to_none=True)
            loss = model(x).sum()
            loss.backward()
            opt.step()
            rec.step(loss=loss)
            if step == 3:
                rec.writer.flush()  # the window (step 2) exported
        assert results is not None, "no profiler window opened"
        assert results() is None, "the window's results are still alive after its export"
    finally:
        rec.close()
        if was_enabled:
            gc.enable()
