"""The suite's two lanes. ``python -m pytest`` runs everything (CI, and the README's command);
``python -m pytest -m "not slow"`` is the loop to run after a change: under 2 minutes on two
cores. Slow are the files whose tests together take 7 s or more (measured with --durations=0 on
2026-11-28, 11 minutes in all): they start subprocesses (the CLI as a user runs it, torchrun,
killed and restarted jobs, a full disk), train real frameworks' models (Lightning, transformers),
record the samples again, open a browser or fuzz traces. A new test file that is slow goes here;
a slow test in a quick file is marked ``@pytest.mark.slow`` with its reason (a subprocess,
transformers, Lightning). The CLI's output is tested in process (tests.helpers.invoke_cli)
unless the real process is the point."""

from __future__ import annotations

import gc
import os
import sys
import tempfile

import pytest

from tests.forked_jobs import job_server, jobs  # noqa: F401  (fixtures: recorded jobs forked, one server a worker)

# One intra-op thread in every test process and the jobs they start (inherited), unless the
# caller sets it: the suite runs two pytest workers on two cores, and torch's default of a thread
# per core made each worker's OpenMP threads spin against the other's. Measured on the
# real-model detector tests (test_input_data, test_params_not_learning; load 9): 97 -> 38 CPU-s,
# 166 -> 77 s wall. The tiny models here gain nothing from a second thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Bytecode for this checkout's sources, in every process of the suite. Where PYTHONDONTWRITEBYTECODE
# is set (this machine and its CI set it), each of the suite's ~400 processes (the CLI, recorded
# jobs, workers) compiled the analyzer's sources again (~0.2 CPU-s a CLI process), and each xdist
# worker redid pytest's assertion rewriting. Installed packages hold their .pyc files already; only
# the checkout gains __pycache__ folders (git ignores them). Measured: a worker's collection 16.8 ->
# 11.9 CPU-s, the CLI's imports 0.93 -> 0.70 CPU-s a process.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    sys.dont_write_bytecode = False

SLOW_FILES = frozenset({
    "tests/cli/test_diff_cli.py",
    "tests/analyzer/test_reused_module_calls.py",
    "tests/analyzer/test_diff_runs.py",
    "tests/analyzer/detectors/test_cross_rank.py",
    "tests/analyzer/detectors/test_input_data.py",
    "tests/analyzer/detectors/test_params_not_learning.py",
    "tests/analyzer/test_activity_attention_memory.py",
    "tests/analyzer/test_corpus_subset.py",
    "tests/analyzer/test_detectors_on_real_runs.py",
    "tests/analyzer/test_evidence_contract.py",
    "tests/analyzer/test_healthy_vision_families.py",
    "tests/analyzer/test_learning_rate_from_the_start.py",
    "tests/analyzer/test_loss_divergence.py",
    "tests/analyzer/test_pathology_definitions.py",
    "tests/analyzer/test_refused_hdf5.py",
    "tests/analyzer/test_samples_rerecorded.py",
    "tests/analyzer/test_slow_leak.py",
    "tests/analyzer/test_streaming_reader.py",
    "tests/analyzer/test_update_ratio.py",
    "tests/cli/test_analyze_samples.py",
    "tests/cli/test_bad_input.py",
    "tests/cli/test_checked_once.py",
    "tests/cli/test_cli_conventions.py",
    "tests/cli/test_killed_and_multirank.py",
    "tests/cli/test_many_rank_files.py",
    "tests/cli/test_memory_snapshot.py",
    "tests/cli/test_output_safety.py",
    "tests/cli/test_output_rule.py",
    "tests/cli/test_profile_and_step_time.py",
    "tests/cli/test_restarts_cli.py",
    "tests/hostile/test_fuzz_traces.py",
    "tests/integrations/test_ddp_exit_status.py",
    "tests/integrations/test_huggingface.py",
    "tests/integrations/test_huggingface_models.py",
    "tests/integrations/test_lightning.py",
    "tests/integrations/test_torchrun.py",
    "tests/integrations/test_torchrun_ranks.py",
    "tests/recorder/test_blackbox_snapshots.py",
    "tests/recorder/test_clean_output.py",
    "tests/recorder/test_compile.py",
    "tests/recorder/test_compile_nanogpt.py",
    "tests/recorder/test_full_disk_exit.py",
    "tests/recorder/test_fused_reductions.py",
    "tests/recorder/test_nan_origin_inf.py",
    "tests/recorder/test_op_counts.py",
    "tests/recorder/test_output_structures.py",
    "tests/recorder/test_recorder_nonfinite.py",
    "tests/recorder/test_recorder_signals.py",
    "tests/recorder/test_restarts.py",
    "tests/recorder/test_schedule_and_amp.py",
    "tests/recorder/test_several_recorders.py",
    "tests/reports/test_report_bounds.py",
    "tests/reports/test_report_browser.py",
    "tests/reports/test_report_html.py",
    "tests/reports/test_report_pdf.py",
    "tests/reports/test_report_ranks.py",
    "tests/reports/test_report_samples.py",
    # 2026-11-28, the quick lane under 2 minutes: a subprocess each (a full disk, the CLI without
    # torch, workers), the CLI writing every report, real frameworks (Accelerate, transformers).
    "tests/recorder/test_recorder_disk_full.py",
    "tests/reports/test_hostile_names.py",
    "tests/reports/test_report_cli.py",
    "tests/analyzer/test_parallel.py",
    "tests/integrations/test_accelerate.py",
    "tests/recorder/test_attention_eager_hf.py",
})


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_under_pytest(tmp_path_factory):
    """Helpers cached across tests make their directories with tempfile.mkdtemp() (a fixture's
    tmp_path dies with its test), and torchrun, Dask and Chromium make theirs under TMPDIR: all of
    them go under pytest's own temporary directory, which pytest prunes (it keeps the last three
    runs), so the suite leaves nothing behind in /tmp."""
    root = str(tmp_path_factory.mktemp("tmp"))
    tempfile.tempdir, before = root, os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = root
    yield
    tempfile.tempdir = None
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before


def pytest_ignore_collect(collection_path, config):
    """In the quick lane (exactly ``-m "not slow"``) the slow files are not even imported: their
    imports (transformers, Lightning, Accelerate) and assertion rewriting cost each worker ~10 s."""
    if config.getoption("markexpr", "") == "not slow":
        try:
            rel = collection_path.relative_to(config.rootpath).as_posix()
        except ValueError:
            return None
        if rel in SLOW_FILES:
            return True
    return None


def pytest_collection_finish(session):
    """What a worker holds once the tests are imported (torch, transformers, Lightning, the test
    modules: ~500,000 objects) is frozen out of the collector, as the job server does its own:
    the recorder's walks of gc's objects (its tensor census and optimizer scan at each run's first
    step) and the worker's full collections then visit only what the tests made since. The
    recorder's walks stay exercised: every tensor, model and optimizer a test makes is after it."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("::")[0] in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
