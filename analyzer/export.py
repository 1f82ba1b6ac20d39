"""Stored tensors out of a trace as safetensors files, without torch and without pickle.

The safetensors format (https://github.com/huggingface/safetensors): an 8-byte little-endian
header length, a JSON header ({name: {"dtype", "shape", "data_offsets"}, "__metadata__": {str:
str}}), then the raw bytes. The trace stores raw bytes too, so a tensor is copied byte for byte:
bfloat16 stays its 16 bits. ``safetensors.torch.load_file(path)`` reads the result; a parameter
file's keys are those of ``model.state_dict()``.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

from .errors import TraceFormatError
from .series import spacing
from .trace import RankTrace
from .trace.profile_blob import profile_chunks

# torch dtype name (as the trace spells it) -> safetensors dtype
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
             "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}


class ExportError(Exception):
    """What was asked for is not in the trace (a one-line reason for the CLI)."""


@dataclass(frozen=True)
class Selection:
    """Tensors picked from a trace: name -> (dtype, shape, bytes), and what they are."""

    tensors: dict[str, tuple[str, tuple[int, ...], bytes]]
    description: str
    metadata: dict[str, str]
    skipped: tuple[str, ...] = ()


def parse_which(which: str) -> int | str:
    w = which.strip().lower()
    if w in ("last", "blackbox"):
        return w
    try:
        step = int(w.replace(",", "").replace("_", ""))
    except ValueError:
        raise ExportError(f"WHICH must be a step number, 'last' or 'blackbox', not {which!r}") from None
    if step < 0:
        raise ExportError(f"WHICH must be a step number >= 0, 'last' or 'blackbox', not {which!r}")
    return step


def _listing(steps, what: str) -> str:
    steps = [f"{int(s):,}" for s in steps]
    if not steps:
        return f"it holds no {what}"
    more = f" ... ({len(steps)} in all)" if len(steps) > 12 else ""
    return f"{what} at steps {', '.join(steps[:12])}{more}"


def _blackbox_row(rt: RankTrace):
    bb = rt.blackbox
    if not len(bb):
        raise ExportError(f"{rt.path} holds no black box: no NaN/Inf, exception or SIGTERM was seen "
                          "(or it was recorded with blackbox=False)")
    return bb.iloc[0]


def _select(rt: RankTrace, rows, source: str, step: int, description: str, metadata: dict,
            verify: int | None = None) -> Selection:
    data = rt.read_tensor_bytes(rows, verify_snapshot=verify)
    tensors, skipped = {}, []
    for (name, dtype, shape, nbytes), raw in zip(
            zip(rows["name"], rows["dtype"], rows["shape"], rows["nbytes"]), data):
        st = SAFETENSORS_DTYPES.get(dtype)
        # Python ints: a numpy product of a crafted shape could wrap around to len(raw).
        if st is None or any(d < 0 for d in shape) or math.prod(shape) * _ITEMSIZE[st] != len(raw):
            skipped.append(f"{name} ({dtype})")
            continue
        tensors[name] = (st, tuple(shape), raw)
    meta = {"source": source, "step": str(step), "run": rt.path, **metadata}
    return Selection(tensors, description, meta, tuple(skipped))


def select_params(rt: RankTrace, which: int | str) -> Selection:
    """The parameters and buffers (state_dict keys) of a snapshot, or of the black box."""
    if which == "blackbox":
        bb = _blackbox_row(rt)
        step = int(bb["step"])
        rows = rt.tensors_of("blackbox", step)
        rows = rows[rows["role"].isin(("param", "buffer"))]
        when = {"start_of_step": f"at the start of step {step:,} (before its bad update)",
                "end_of_step": f"at the end of step {step:,} (after its update: no optimizer step saw it first)",
                "at_exit": f"when the job left at step {step:,}"}.get(bb["params_at"], f"at step {step:,}")
        return _select(rt, rows, "blackbox", step, f"the black box's parameters, {when}; trigger: {bb['trigger']}",
                       {"params_at": str(bb["params_at"]), "trigger": str(bb["trigger"])})
    snaps = rt.snapshots
    if not len(snaps):
        raise ExportError(f"{rt.path} holds no parameter snapshots (recorded with snapshot_every=0, an older "
                          "recorder, or a model larger than snapshot_budget_bytes)")
    step = int(snaps["step"].iloc[-1]) if which == "last" else which
    if step not in set(snaps["step"].astype(int)):
        raise ExportError(f"{rt.path} has no snapshot of step {step:,}; {_listing(snaps['step'], 'snapshots')}")
    dtype = str(snaps.loc[snaps["step"] == step, "dtype"].iloc[-1])
    rows = rt.tensors_of("snapshot", step)
    note = "" if dtype == "exact" else f", floats stored as {dtype}"
    return _select(rt, rows, "snapshot", step, f"parameters at the start of step {step:,}{note}",
                   {"snapshot_dtype": dtype}, verify=step)


def select_tensors(rt: RankTrace, which: int | str) -> Selection:
    """Sampled activations/gradients of a step, or the black box's inputs, gradients, optimizer
    state and RNG states."""
    if which == "blackbox":
        bb = _blackbox_row(rt)
        step = int(bb["step"])
        rows = rt.tensors_of("blackbox", step)
        rows = rows[~rows["role"].isin(("param", "buffer"))]
        values = bb["detail"].get("values", {}) if isinstance(bb["detail"], dict) else {}
        meta = {"trigger": str(bb["trigger"]), "params_at": str(bb["params_at"]),
                "values": json.dumps(values)[:100_000]}
        roles = ", ".join(sorted(set(rows["role"]))) or "nothing"
        return _select(rt, rows, "blackbox", step, f"the black box of step {step:,} ({roles})", meta)
    t = rt.stored_tensors
    steps = sorted(set(t.loc[t["source"] == "sample", "step"].astype(int)))
    if not steps:
        raise ExportError(f"{rt.path} holds no sampled tensors (recorded with sample_every=0, or an older "
                          "recorder); --tensors blackbox exports the black box")
    step = steps[-1] if which == "last" else which
    if step not in steps:
        raise ExportError(f"{rt.path} has no sampled tensors of step {step:,}; {_listing(steps, 'samples')}")
    rows = rt.tensors_of("sample", step)
    return _select(rt, rows, "sample", step, f"sampled activations and gradients of step {step:,}", {})


def safetensors_bytes(sel: Selection) -> bytes:
    """The safetensors file of a selection."""
    return b"".join(safetensors_chunks(sel))


def safetensors_chunks(sel: Selection) -> list[bytes]:
    """The safetensors file of a selection, as its header and the tensors' bytes (written one
    after the other, so the tensors are not copied once more into one buffer)."""
    header: dict = {"__metadata__": {str(k): str(v) for k, v in sel.metadata.items()}}
    offset = 0
    for name, (dtype, shape, raw) in sel.tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return [struct.pack("<Q", len(text)) + text, *(raw for _, _, raw in sel.tensors.values())]


__all__ = ["ExportError", "Selection", "parse_which", "select_params", "select_tensors", "safetensors_bytes",
           "safetensors_chunks", "profile_chunks", "TraceFormatError"]


def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MB" if n >= 2**20 else f"{n / 1024:,.1f} KB"


def fired_blackbox(trace, prefer: int | None = None):
    """(rank trace, its black box row, the export command's rank option) of the rank ``prefer``
    (the first to go wrong) if its black box fired, else of the lowest rank whose did, or None."""
    from .errors import TraceError

    ranks = sorted(trace.ranks.values(), key=lambda rt: (rt.rank != prefer, rt.rank))
    digests = getattr(trace, "digests", None) or {}  # (after analyze: which ranks' black box fired)
    ranks = [rt for rt in ranks if rt.rank not in digests or digests[rt.rank].blackbox_fired]
    for rt in ranks:
        try:
            bb = rt.blackbox
        except TraceError:
            continue
        if len(bb):
            return rt, bb.iloc[0], (f" --rank {rt.rank}" if len(trace.ranks) > 1 else "")
    return None


def describe_stored(rt: RankTrace) -> list[tuple[str, bool, str]]:
    """(what, present, detail) lines for the snapshots, samples, histograms and black box a
    trace holds: for ``info`` and the report's appendix."""
    cfg = rt.meta.get("config", {}) if isinstance(rt.meta.get("config"), dict) else {}
    out = []
    snaps = rt.snapshots
    if len(snaps):
        nbytes = int(snaps["nbytes"].sum())
        dtype = str(snaps["dtype"].iloc[-1])
        out.append(("Parameter snapshots", True,
                    f"{len(snaps)}: {_listing(snaps['step'], 'the parameters')} ({_size(nbytes)} in all"
                    + ("" if dtype == "exact" else f", floats as {dtype}")
                    + f"; one every {cfg.get('snapshot_every', '?')} steps; past snapshot_budget_bytes the oldest "
                      "is dropped, never the first) — torchautopsy export RUN_DIR --params STEP|last OUT.safetensors"))
    elif rt.meta.get("snapshot_note"):
        out.append(("Parameter snapshots", False, f"none: {rt.meta['snapshot_note']}"))
    else:
        out.append(("Parameter snapshots", False, "none (snapshot_every=0, an older recorder, or a model "
                    "larger than snapshot_budget_bytes)" if "snapshot_every" in cfg or not cfg
                    else "not recorded by this recorder version"))
    t = rt.stored_tensors
    samples = t[t["source"] == "sample"]
    if len(samples):
        mods = sorted({n.rsplit(".", 1)[0] for n in samples["name"]})
        out.append(("Sampled activations and gradients", True,
                    f"outputs and their gradients of {', '.join(m or '(model)' for m in mods[:6])}"
                    f"{' ...' if len(mods) > 6 else ''}, {_listing(sorted(set(samples['step'].astype(int))), 'samples')}"
                    f" (every {cfg.get('sample_every', '?')}) — torchautopsy export RUN_DIR --tensors STEP|last "
                    "OUT.safetensors"))
    else:
        out.append(("Sampled activations and gradients", False, "none (sample_every=0, or not recorded)"))
    steps = rt.histogram_steps
    out.append(("Histograms of weights, gradients, activations", len(steps) > 0,
                f"{len(steps):,} steps (every {spacing(steps) or cfg.get('histogram_every', '?')}); fixed bins, "
                "NaN and ±Inf counted"
                if len(steps) else "none (histogram_every=0, or not recorded)"))
    bb = rt.blackbox
    if len(bb):
        row = bb.iloc[0]
        step = int(row["step"])
        roles = rt.tensors_of("blackbox", step)["role"]
        counts = ", ".join(f"{int((roles == r).sum())} {r}" for r in
                           ("param", "buffer", "input", "grad", "optimizer", "rng") if (roles == r).any())
        when = {"start_of_step": "before the bad update", "end_of_step": "after the step's update",
                "at_exit": "at exit"}.get(str(row["params_at"]), str(row["params_at"]))
        out.append(("Black box", True, f"fired at step {step:,} ({row['trigger']}); parameters {when}; "
                    f"tensors: {counts} — torchautopsy export RUN_DIR --params blackbox params.safetensors "
                    "--tensors blackbox inputs.safetensors"))
    else:
        on = cfg.get("blackbox")
        out.append(("Black box", False, "armed, never fired (no NaN/Inf, exception or SIGTERM)" if on
                    else "off (blackbox=False)" if on is False else "not recorded by this recorder version"))
    return out
