"""Seeded mutators that turn a real sample trace into a damaged or hostile copy (issue 20).

Every class is a function ``(path or h5py.File, rng, kind) -> detail`` that damages a copy of a
sample trace in place and says what it did; the seed picks the variant (``kind``, one of the
function's KINDS) and seeds the rng for the rest. ``make_trial(cls, seed, dir)`` is deterministic
in (cls, seed), so a failure reproduces with

    python -m tests.hostile.mutations CLASS SEED OUT_DIR     # writes OUT_DIR/rank0.h5

Byte-level damage (truncation, flips, overwrites) works on raw bytes, structural damage with
h5py (both in tests/hostile/damage.py); hostile content (names, attributes, links, JSON, indices,
CUDA memory tables) is here. Nothing here reaches outside the file (external links/storage, virtual datasets and
plugin filters have their own tests).
"""

from __future__ import annotations

import shutil
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"
BASES = sorted(p.parent.name for p in SAMPLES.glob("*/rank0.h5"))
from tests.hostile.damage import (  # noqa: E402
    byte_flips, compression_bomb, delete, huge_dims, length_mismatch, nonfinite, overwrite_512, step_numbers,
    truncate, wrong_dtype, wrong_shape)
from tests.hostile.h5edit import (  # noqa: E402,F401  (replace, texts: tests/cli/test_memory_snapshot.py)
    STR, as_bytes, datasets, existing, hostile_ints, is_str, kinds, pick, replace, texts)
from tests.hostile.targets import (  # noqa: E402,F401  (data, kept apart from the mutators)
    SCRIPT, IMG, MD_LINK, PAYLOADS, LONG_INT, DEEP_JSON, INDEX_DATASETS, JSON_TEXTS, NAME_LISTS, PER_STEP, MEMORY_ROWS)


# -- hostile content: names, attributes, links, JSON texts, indices, memory tables -----------------
@kinds("params", "modules", "params_and_columns")
def many_names(f, rng, kind):
    n = 3_000_000
    which = "modules/name" if kind == "modules" else "params/name"
    replace(f, which, data=texts([f"layer{i}.weight" for i in range(n)], (n,)), dtype=STR)
    if kind == "params_and_columns":  # columns to match: declared, never written
        rows = f["steps/step"].shape[0]
        replace(f, "params/numel", data=np.ones(n, np.int64))
        for s in PER_STEP[1:5]:
            replace(f, s, shape=(rows, n), dtype=f[s].dtype, chunks=(1, 1 << 18), maxshape=(None, n))
        return f"{n:,} parameter names, stats declared {rows} x {n:,}"
    return f"{n:,} names in {which}"


@kinds("names", "all_strings", "one", "duplicates")
def hostile_names(f, rng, kind):
    strs = [n for n in datasets(f, nonempty=True) if is_str(f[n]) and f[n].ndim == 1]
    victims = {"names": ["params/name", "modules/name"], "all_strings": strs, "one": [pick(rng, strs)],
               "duplicates": ["params/name", "modules/name"]}[kind]
    for name in victims:
        n = f[name].shape[0]
        if kind == "duplicates":  # every name the same payload
            vals = [PAYLOADS[int(rng.integers(len(PAYLOADS)))]] * n
        else:  # each a payload, unique by its index; the first entries cycle through all of them
            start = int(rng.integers(len(PAYLOADS)))
            vals = [as_bytes(PAYLOADS[(start + i) % len(PAYLOADS)]) + str(i).encode() for i in range(n)]
        replace(f, name, data=texts(vals, (n,)), dtype=STR, maxshape=(None,), chunks=True)
    return f"{kind}: {len(victims)} string dataset(s) ({victims[0]}...)"


ATTR_VALUES = {
    "rank": ["0", "zero", -1, 2**62, np.array([0, 1]), 1.5, np.nan],
    "world_size": [2**62, "many", -3, np.nan],
    "schema_version": ["2", 2.0, -1, np.array([2]), 10**18],
    "model_class": ["M" * 100_000, SCRIPT + IMG, "\x1b]8;;http://evil\x1b\\x\x1b]8;;\x1b\\\x07\r\x9b"],
    "config": ["{not json", "[1, 2]", '{"activations_every": "x"}', DEEP_JSON, LONG_INT, "null"],
    "start_unix": ["yesterday", np.nan, 1e300, -1e300], "start_time": ["T" * 100_000, "\x1b[2J"],
    "n_parameters": ["many", 2**63 - 1, -5, 1e300], "closed": ["yes", np.array([1, 0])],
    "end_reason": [SCRIPT, "exception: \x1b[31mboom\r\n" * 3], "host": [MD_LINK, "h\x9b\x07"],
    "created_by": [IMG], "torch_version": ["\x1b[31m"], "command": [MD_LINK + "\n" * 50],
    "device": [SCRIPT], "model_summary": ["S\n" * 40_000 + SCRIPT], "dropped_steps": ["x", 2**62, -1],
    "n_steps_recorded": [2**62, "x"], "end_unix": ["later", np.inf],
}


@kinds(f"{k}#{i}" for k, vs in ATTR_VALUES.items() for i in range(len(vs)))
def attrs(f, rng, kind):
    """Sets the attribute value ``kind`` names ("key#index"), and half the time one more at random."""
    done = [kind]
    if rng.random() < 0.5:
        done.append(pick(rng, attrs.KINDS))
    for k in done:
        key, i = k.split("#")
        f.attrs[key] = ATTR_VALUES[key][int(i)]
    return "; ".join(f"{k}={str(ATTR_VALUES[k.split('#')[0]][int(k.split('#')[1])])[:40]!r}" for k in done)


@kinds("self_loop", "pair_loop", "group_loop", "hard_cycle", "dangling")
def links(f, rng, kind):
    name = pick(rng, existing(f, NAME_LISTS + PER_STEP + ["steps/time_s"]))
    if kind in ("group_loop", "hard_cycle"):
        name = pick(rng, ["steps", "params", "modules", "activations", "tensors"][:5 if kind == "group_loop" else 3])
    if kind == "hard_cycle":  # a group that contains itself
        f[f"{name}/again"] = f[name]
        return f"{kind} at {name}"
    del f[name]
    if kind == "pair_loop":
        f[name] = h5py.SoftLink("/loop_b")
        f["loop_b"] = h5py.SoftLink("/" + name)
    else:  # a link to itself (a dataset's or a whole group's), or to nothing
        f[name] = h5py.SoftLink("/no/such/thing" if kind == "dangling" else "/" + name)
    return f"{kind} at {name}"


@kinds(f"[{LONG_INT}]", DEEP_JSON, "[1e999]", "[-1]", "[4611686018427387904, 4611686018427387904]",
       "NaN", '{"a": ' * 5000, "[1.5]", '["x"]', "null", "", "{}", f'{{"k": {LONG_INT}}}')
def json_texts(f, rng, kind):
    name = pick(rng, [n for n in existing(f, JSON_TEXTS) if f[n].size])
    n = f[name].shape[0]
    replace(f, name, data=texts([kind] * n, (n,)), dtype=STR, maxshape=(None,), chunks=True)
    return f"{name} = {kind[:30]!r}..."


@kinds(*INDEX_DATASETS)
def index_values(f, rng, kind):
    if kind not in f or not f[kind].size:
        return f"{kind}: absent or empty in this trace, left alone"
    ds = f[kind]
    v = int(pick(rng, hostile_ints(ds.dtype)))
    if rng.random() < 0.5:
        ds[...] = np.full(ds.shape, v, dtype=ds.dtype)
        return f"{kind}[:] = {v}"
    i = int(rng.integers(ds.shape[0]))
    ds[i] = v
    return f"{kind}[{i}] = {v}"


def add_memory_snapshot(f):
    for table, cols in MEMORY_ROWS.items():
        for col, vals in cols.items():
            name = f"{table}/{col}"
            if isinstance(vals[0], str):
                replace(f, name, data=texts(vals, (len(vals),)), dtype=STR, maxshape=(None,), chunks=True)
            else:
                dt = f[name].dtype if name in f else np.int64
                replace(f, name, data=np.asarray(vals, dtype=dt), maxshape=(None,), chunks=True)


@kinds("n_device_traces", "long_int", "deep_json", "json_not_dict", "all_keys", "stack_index",
       "stack_span", "frame_index", "segment_index", "trace_device", "n_device_traces_neg",
       "huge_sizes", "override_keys")
def memory(f, rng, kind):
    if kind in ("n_device_traces", "n_device_traces_neg"):  # the column is int32: 2**40 needs int64
        replace(f, "memory_snapshots/n_device_traces", data=np.array([2**40 if kind == "n_device_traces" else -5]))
        return f"n_device_traces = {f['memory_snapshots/n_device_traces'][0]}"
    if kind in ("long_int", "deep_json", "json_not_dict", "override_keys"):
        name = pick(rng, ["memory_snapshots/extra", "memory_snapshots/allocator_settings", "memory_segments/extra",
                          "memory_blocks/extra", "memory_trace/extra", "memory_frames/extra"])
        value = {"long_int": f'{{"x": {LONG_INT}}}', "deep_json": DEEP_JSON, "json_not_dict": f"[{LONG_INT[:20]}]",
                 "override_keys": '{"segments": 5, "device_traces": "x", "size": "huge", "frames": 3}'}[kind]
        n = f[name].shape[0]
        replace(f, name, data=texts([value] * n, (n,)), dtype=STR)
        return f"{name} = {value[:30]!r}"
    name = pick(rng, {
        "all_keys": ["memory_snapshots/keys", "memory_segments/keys", "memory_blocks/keys", "memory_trace/keys"],
        "stack_index": ["memory_segments/stack", "memory_blocks/stack", "memory_trace/stack"],
        "stack_span": ["memory_stacks/first", "memory_stacks/length"], "frame_index": ["memory_stack_frames/frame"],
        "segment_index": ["memory_blocks/segment"], "trace_device": ["memory_trace/device"],
        "huge_sizes": ["memory_blocks/size", "memory_trace/size", "memory_segments/total_size"]}[kind])
    v = -1 if kind == "all_keys" else int(pick(rng, hostile_ints(f[name].dtype)))
    f[name][...] = np.full(f[name].shape, v, dtype=f[name].dtype)
    return f"{name}[:] = {v}"


@kinds("untouched")
def control(f, rng, kind):  # the harness must pass an untouched trace
    return "untouched copy"


# name -> (mutator, works on raw bytes, needs memory snapshot rows)
MUTATIONS = {
    "control": (control, False, False), "control_memory": (control, False, True),
    **{fn.__name__: (fn, True, False) for fn in (truncate, byte_flips, overwrite_512)},
    **{fn.__name__: (fn, False, False) for fn in (
        delete, wrong_dtype, wrong_shape, length_mismatch, nonfinite, step_numbers, huge_dims, compression_bomb,
        many_names, hostile_names, attrs, links, json_texts, index_values)},
    "memory": (memory, False, True),
}


def kind_of(cls: str, seed: int) -> str:
    kinds = MUTATIONS[cls][0].KINDS
    return kinds[seed % len(kinds)]


def seed_for(cls: str, kind: str) -> int:
    """The smallest seed whose trial is of that variant (the tests name the issue's cases so)."""
    return MUTATIONS[cls][0].KINDS.index(kind)


@dataclass
class Trial:
    cls: str
    seed: int
    run_dir: Path
    base: str
    detail: str
    has_memory: bool

    @property
    def label(self) -> str:
        return f"{self.cls} seed={self.seed} base={self.base}: {self.detail}"


def make_trial(cls: str, seed: int, out_dir) -> Trial:
    """``out_dir/rank0.h5``: a sample trace damaged by mutation class ``cls`` with ``seed``."""
    fn, raw, needs_memory = MUTATIONS[cls]
    rng = np.random.default_rng([seed, zlib.crc32(cls.encode())])
    base = pick(rng, BASES)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "rank0.h5"
    shutil.copyfile(SAMPLES / base / "rank0.h5", path)
    if needs_memory:
        with h5py.File(path, "r+") as f:
            add_memory_snapshot(f)
    if raw:
        detail = fn(path, rng, kind_of(cls, seed))
    else:
        with h5py.File(path, "r+") as f:
            detail = fn(f, rng, kind_of(cls, seed))
    return Trial(cls, seed, out_dir, base, detail, needs_memory)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in MUTATIONS:
        sys.exit(f"usage: python -m tests.hostile.mutations CLASS SEED OUT_DIR\nclasses: {', '.join(MUTATIONS)}")
    t = make_trial(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    print(f"{t.run_dir / 'rank0.h5'}: {t.label}")
