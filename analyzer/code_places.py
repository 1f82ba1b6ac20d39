"""Where to look: the file and line of the code behind each module or parameter a finding names,
from the sources the recorder read when it started (recorder/trace_file/module_sources.py), as
``evidence["code"] = {"features.log": "LogFeatures, models/features.py:42"}``.

A module of torch's own (an ``nn.Linear``) is code nobody will edit: what to read is the forward
that calls it, so such a module is given with its nearest enclosing module of other code
("Linear in encoder.layer.0.attention.self: BertSelfAttention, .../modeling_bert.py:120,
forward at line 170"). A NaN/Inf born in a module's forward gives that forward's line."""

from __future__ import annotations

from dataclasses import replace

from .findings import Finding

TORCH_CODE = ("torch/", "torch\\")
MAX_NAMES = 8  # the where entries given a place (findings list at most a few)


def with_code(f: Finding, rt) -> Finding:
    """``f`` with ``evidence["code"]`` for the modules and parameters it names, where known."""
    sources = getattr(rt, "module_class_source", None)
    if not f.where or not isinstance(f.evidence, dict) or not sources or not any(sources):
        return f
    index = {n: i for i, n in enumerate(rt.module_names)}
    params = set(rt.param_names)
    forward_first = f.kind == "nonfinite" and f.evidence.get("stage") == "forward"
    code = {}
    for name in f.where[:MAX_NAMES]:
        module = name if name in index else name.rpartition(".")[0] if name in params else None
        if module is None or module not in index:
            continue
        text = _place(rt, index, module, forward_first)
        if text:
            code[name] = text
    return replace(f, evidence={**f.evidence, "code": code}) if code else f


def _place(rt, index: dict, module: str, forward_first: bool) -> str:
    i = index[module]
    cls, fwd = rt.module_class_source[i], rt.module_forward_source[i]
    own = rt.module_types[i]
    if cls and not cls.startswith(TORCH_CODE):
        return _described(own, cls, fwd, forward_first)
    parent = module
    while parent:  # the nearest enclosing module whose code is not torch's
        parent = parent.rpartition(".")[0]
        j = index.get(parent)
        if j is None:
            continue
        pcls, pfwd = rt.module_class_source[j], rt.module_forward_source[j]
        if pcls and not pcls.startswith(TORCH_CODE):
            where = parent or "the model"
            return f"{own} in {where}: {_described(rt.module_types[j], pcls, pfwd, forward_first=True)}"
    return f"{own}, {cls}" if cls else ""


def _described(cls_name: str, cls: str, fwd: str, forward_first: bool) -> str:
    """"Name, file:line, forward at line N" (the forward's own file where it is elsewhere)."""
    text = f"{cls_name}, {cls}"
    if not fwd or fwd == cls:
        return text
    cfile, fline = cls.rpartition(":")[0], fwd.rpartition(":")[2]
    forward = f"forward at line {fline}" if fwd.rpartition(":")[0] == cfile else f"forward at {fwd}"
    return f"{cls_name}.forward, {fwd} (class at {cls})" if forward_first else f"{text}, {forward}"
