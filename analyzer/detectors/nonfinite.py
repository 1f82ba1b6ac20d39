"""nonfinite: NaN/Inf appeared; the first step, and where it was born.

Within a step the order is: the input batch, the forward pass (modules, in the order they
completed), the loss, the backward pass, the optimizer update. The recorder marks, for each
step, the first module whose output was non-finite while its inputs were finite
(steps/nonfinite_origin): the module that produced the NaN rather than passed it on. If the
forward pass was clean, and the gradient that reached the model's outputs was already
non-finite (checked on watched steps), the NaN was born in the loss function's backward;
otherwise the first parameter the backward pass reached (the last in definition order) with a
non-finite gradient is named; if gradients were clean but weights went
non-finite after the update, the optimizer is.

Module outputs are checked on the steps the recorder watches (every `activations_every`-th); a
bad step it did not watch is run again on a copy of the model to find the module (the black
box's replay). If that replay did not reproduce the NaN/Inf (the forward depends on state the
step changed outside the model's parameters, buffers and RNG), the step's module outputs were
never checked (-1) and the finding says so instead of blaming the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..display import ordinal
from ..findings import Evidence as BaseEvidence, Finding
from ..trace import RankTrace, measured_rows
from ..trace.format import MAX_SITE_CALLS
from . import _loss_ops


@dataclass(frozen=True)
class NonfiniteConfig:
    pass


class Evidence(BaseEvidence, total=False):
    first_step: int  # the first step with NaN/Inf anywhere: the finding's step
    nonfinite_steps_after: int  # steps from it on (it included) whose loss, gradients or weights were NaN/Inf
    steps_recorded_after: int  # steps recorded from it on, it included
    loss_at_step: float  # the loss recorded on that step (NaN/Inf, or finite when the fault came after it)
    loss_before: float  # the loss of the step before (None: it was the first step)
    total_grad_norm_before: float  # the L2 norm of all gradients on the step before (None: first step)
    modules_with_nonfinite_output: int  # modules whose output held NaN/Inf on the step (0 also when none was checked)
    params_with_nonfinite_grad: dict  # parameter -> NaN/Inf elements in its gradient (the first 20)
    loss_ops: list  # the loss function's autograd nodes, loss first (recorder/blackbox/loss_graph.py)
    outputs_nonfinite_on_step: bool  # the model's own outputs held NaN/Inf on the step
    origin_module_output_absmax: float  # (forward) the max |output| of the module that made it: Inf or NaN
    chain: dict  # (forward) producer and consumer module of a -Inf made NaN/+Inf, and the step
    origin_call: int  # (forward, a module called more than once in the step) its call that made it, 0 the first
    origin_calls: int  # (forward) how many times the module ran in that step


KIND = "nonfinite"
REQUIRES = ("steps/nonfinite_origin", "params/grad_nonfinite")
CONFIG = NonfiniteConfig  # its thresholds: a [nonfinite] table of analyze --config
ORDER = 10  # among findings of one step and stage, the detectors run (and list) in this order

_ADVICE = {
    "batch": "The data itself holds NaN/Inf: check the data pipeline and preprocessing for the "
             "batch of this step (missing values, division by a zero std, log of zero).",
    "forward": "Find the operation in this module's forward that can overflow or is undefined on "
               "its inputs (log/sqrt of non-positive values, division by ~0, exp of large values, "
               "softmax of all -inf); guard it (clamp, eps: log(x + eps), x.clamp_min(eps).log()), "
               "or run it in float32 under autocast. A -Inf is fine only where a softmax or a masked "
               "fill takes it.",
    "loss": "The loss is computed outside the model's modules: check it for log(0) (use "
            "log_softmax / BCEWithLogitsLoss instead of log(softmax) / BCELoss), division by a zero "
            "count, or targets out of range.",
    "backward": "The gradient is non-finite while the forward pass was finite: an operation whose "
                "derivative is unbounded at its input (sqrt or pow at 0, norm of a zero vector, acos "
                "at +-1), or a gradient overflow under fp16 (use a GradScaler). Clip or add eps. When "
                "every parameter's gradient went non-finite, look above the last layer first: the loss "
                "(log of 0: use log_softmax / BCEWithLogitsLoss; sqrt of a zero distance: add eps).",
    "loss_backward": "Find the operation in the loss whose derivative is unbounded at its input: sqrt or "
                     "norm of an exact 0 (a distance between identical embeddings: add eps inside the sqrt, "
                     "sqrt(x + 1e-12)), log of 0 (use log_softmax / BCEWithLogitsLoss), division by a value "
                     "that can reach 0.",
    "unchecked": "Record again with Recorder(..., activations_every=1), which checks every module's "
                 "output on every step, to name the module where the NaN/Inf was born.",
    "optimizer": "Gradients were finite but the weights went non-finite after the update: a learning "
                 "rate too high, an optimizer eps of 0, or a division by a zero state.",
}


def detect(rt: RankTrace, cfg: NonfiniteConfig) -> list[Finding]:
    m = _measure(rt)
    if m is None:
        return []
    stage = _stage(m)
    # (backward) Every gradient went bad, the ones backward reaches first included: the NaN/Inf
    # came in at or above the last layer. Only asked when the step did not tell whether the
    # gradient at the outputs was already non-finite (a watched step, or the replay's backward).
    from_above = stage == "backward" and m.out_grad == -1 and _entered_at_outputs(rt, m.row, m.grad_bad)
    where, what = _birth(rt, m, stage, from_above)
    summary = (f"First NaN/Inf at step {m.step}: {what}; "
               f"{m.steps_after} of the {m.recorded_after} steps recorded from then on are non-finite.")
    advice = _ADVICE[stage]
    if stage in ("loss", "loss_backward") or (stage == "backward" and from_above):
        advice = _loss_ops.advice(m.ops) + advice
    return [Finding(KIND, "error", m.step, where, summary, _evidence(rt, m, stage), advice)]


@dataclass(frozen=True)
class _FirstBadStep:
    """What the trace holds on the first step with NaN/Inf anywhere (its row ``row``)."""

    row: int
    step: int
    steps_after: int  # non-finite steps from this one on, it included
    recorded_after: int  # steps recorded from this one on, it included
    loss: float  # the loss recorded on the step, as the trace holds it
    loss_before: float | None  # the loss of the step before (None: the first step)
    grad_norm_before: float | None  # the total gradient norm of the step before
    batch_bad: bool  # the input batch held NaN/Inf
    origin: int  # the first module whose output went non-finite from finite inputs, or -1
    consumer: int  # the module that took the origin's -Inf in and made NaN/+Inf of it, or -1
    loss_bad: bool  # the loss itself was NaN/Inf
    outs_bad: int  # the model's outputs held NaN/Inf (read from the loss's graph): 1, 0, -1 not known
    ops: list | None  # the loss function's autograd ops, if recorded
    out_grad: int  # the gradient at the model's outputs was NaN/Inf: 1, 0, -1 not known
    module_absmax: np.ndarray  # per module, its max |output| on the step (-1: not checked)
    grad_nonfinite: np.ndarray  # per parameter, its NaN/Inf gradient elements
    weight_bad: np.ndarray  # per parameter, its norm went non-finite after the update

    @property
    def checked(self) -> bool:
        """The step's module outputs were checked (-1 everywhere: they were not)."""
        return bool(measured_rows(self.module_absmax))

    @property
    def grad_bad(self) -> np.ndarray:
        return self.grad_nonfinite > 0


def _measure(rt: RankTrace) -> _FirstBadStep | None:
    steps, idx, d = rt.columns, rt.step_index, rt.digest
    loss = steps["loss"].to_numpy()
    origin = steps["nonfinite_origin"].to_numpy()
    batch_bad = steps["batch_nonfinite"].to_numpy() > 0
    # Counts, not norms: an Inf norm can be an overflow of finite gradients.
    # NaN also stands for "no loss passed to rec.step() on this step": a NaN loss counts when the
    # trace says a loss was given (cross_entropy with every target ignored is 0/0 = NaN with
    # gradients of exactly 0), or, in traces that do not say, when the backward was non-finite too.
    given = steps["loss_given"].to_numpy()
    loss_bad = np.isinf(loss) | (np.isnan(loss) & ((given == 1) | d.grad_nonfinite))
    any_bad = loss_bad | (origin >= 0) | batch_bad | d.grad_nonfinite | d.param_nonfinite
    bad_rows = np.flatnonzero(any_bad)
    if not bad_rows.size:
        return None
    i = int(bad_rows[0])
    step = int(idx[i])
    # The loss function on this step, read by the recorder from its graph (recorder/blackbox/loss_graph.py):
    # whether the model's own outputs were finite, and the loss's ops.
    check = rt.loss_checks.get(step, {})
    # The first bad step's own rows: that is all of the steps x tensors tables it needs.
    return _FirstBadStep(
        row=i, step=step, steps_after=int(any_bad[i:].sum()), recorded_after=int(len(idx) - i),
        loss=steps["loss"].iloc[i],
        loss_before=float(steps["loss"].iloc[i - 1]) if i > 0 else None,
        grad_norm_before=float(rt.total_grad_norm.iloc[i - 1]) if i > 0 else None,
        batch_bad=bool(batch_bad[i]), origin=int(origin[i]), consumer=int(steps["nonfinite_consumer"].iloc[i]),
        loss_bad=bool(loss_bad[i]), outs_bad=check.get("outputs_nonfinite", -1), ops=check.get("ops"),
        out_grad=int(steps["output_grad_nonfinite"].iloc[i]),
        module_absmax=rt.module_rows(rows=[i]).to_numpy()[0],
        grad_nonfinite=rt.param_stat("grad_nonfinite", rows=[i]).to_numpy()[0],
        weight_bad=~np.isfinite(rt.param_stat("param_norm", rows=[i]).to_numpy()[0]))


def _stage(m: _FirstBadStep) -> str:
    """Where in the step the NaN/Inf was born: the first part of the step, in the order it runs
    them, that was non-finite while what fed it was finite."""
    if m.batch_bad:
        return "batch"
    if m.origin >= 0:
        return "forward"
    if m.loss_bad:
        # Unchecked modules clear the forward pass only if the model's outputs were checked.
        return "loss" if m.checked or m.outs_bad == 0 else "unchecked"
    if m.grad_bad.any():
        # The gradient arriving at the model's outputs was NaN/Inf already: born in the backward
        # of the loss, outside the model (sqrt/norm of 0, log(0) in a hand-written loss).
        return "loss_backward" if m.out_grad == 1 else "backward"
    return "optimizer"


def _chained(rt: RankTrace, m: _FirstBadStep) -> bool:
    """The origin made a -Inf (a log of 0, say), which another module turned into NaN/+Inf."""
    return 0 <= m.consumer < len(rt.module_names) and m.consumer != m.origin


def _evidence(rt: RankTrace, m: _FirstBadStep, stage: str) -> Evidence:
    evidence = {
        "first_step": m.step,
        "nonfinite_steps_after": m.steps_after,
        "steps_recorded_after": m.recorded_after,
        "loss_at_step": float(m.loss),
        "loss_before": m.loss_before,
        "total_grad_norm_before": m.grad_norm_before,
        "modules_with_nonfinite_output": len(np.flatnonzero(~np.isfinite(m.module_absmax))),
        "params_with_nonfinite_grad": {rt.param_names[j]: int(m.grad_nonfinite[j])
                                       for j in np.flatnonzero(m.grad_bad)[:20]},
    }
    if m.ops is not None:
        evidence["loss_ops"] = m.ops
    if m.outs_bad != -1:
        evidence["outputs_nonfinite_on_step"] = bool(m.outs_bad)
    if stage == "forward":
        evidence["origin_module_output_absmax"] = float(m.module_absmax[m.origin])
        call = _origin_call(rt, m.origin, m.step)
        if call is not None:
            evidence["origin_call"], evidence["origin_calls"] = call
        if _chained(rt, m):
            evidence["chain"] = {"producer": rt.module_names[m.origin], "consumer": rt.module_names[m.consumer],
                                 "step": m.step}
    evidence["stage"] = stage
    return evidence


def _birth(rt: RankTrace, m: _FirstBadStep, stage: str, from_above: bool) -> tuple[list[str], str]:
    """(where, what happened): the finding's names, and its summary's account of the birth."""
    step = m.step
    if stage == "batch":
        return [], f"the input batch of step {step} already held NaN/Inf"
    if stage == "forward":
        return [rt.module_names[m.origin]], _forward_birth(rt, m)
    if stage == "loss" and not m.checked:
        return [], (f"the model's outputs were finite at step {step} (checked on the step itself) but the loss was "
                    f"{m.loss}: the loss function made it{_loss_ops.clause(m.ops, True)}")
    if stage == "unchecked":
        # (no word on the loss function's ops: nothing says the NaN/Inf was born there)
        what = (f"the loss was {m.loss} at step {step}, a step whose module outputs were not "
                f"checked (the recorder watches every module on sampled steps) and whose replay on a copy of "
                f"the model found no origin: {_replay_said(rt, step)}")
        return [], what + ("; the model's outputs already held NaN/Inf on that step" if m.outs_bad == 1 else "")
    if stage == "loss":
        return [], (f"every module output was finite at step {step} but the loss was {m.loss}"
                    f"{_loss_ops.clause(m.ops, True)}")
    if stage == "loss_backward":
        return [], (f"the forward pass and the loss of step {step} were finite, but the gradient the loss sent "
                    f"back to the model's outputs was already NaN/Inf: it was born in the loss function's backward "
                    f"({len(np.flatnonzero(m.grad_bad))} parameter(s) got NaN/Inf gradients from it)"
                    f"{_loss_ops.clause(m.ops, False)}")
    if stage == "backward":
        return _backward_birth(rt, m, from_above)
    bad_w = np.flatnonzero(m.weight_bad)
    return [rt.param_names[j] for j in bad_w[:5]], (f"gradients at step {step} were finite but {len(bad_w)} "
                                                    f"parameter(s) went non-finite in the optimizer update")


def _replay_said(rt: RankTrace, step: int) -> str:
    """Why the black box's replay of the step found no origin, in its own words."""
    box = rt.blackbox
    said = ""
    for _, row in box[box["step"] == step].iterrows():
        said = str(row["detail"].get("trigger_detail", {}).get("origin_replay", "") or "")
    if not said:
        return "the black box did not replay this step (it fired on another step, or was off)"
    if said.startswith("not reproduced"):
        return (said + " (the step's NaN/Inf depends on something the replay does not restore: state "
                "outside the model's parameters, buffers, RNG and inputs, such as a counter a hook or the "
                "forward reads, or a change to the inputs after the forward began)")
    return said


def _origin_call(rt: RankTrace, module: int, step: int) -> tuple[int, int] | None:
    """(the call that first gave a non-finite output, the calls it ran) of a module called more
    than once on the step (call_sites: the recorder's per-call outputs, on watched steps); None
    for a module called once, or a step without per-call outputs (replayed, older traces)."""
    sites = rt.call_sites
    mine = np.flatnonzero(sites["module_index"].to_numpy() == module) if len(sites) else []
    if not len(mine):
        return None
    row = rt.call_stat("output_absmax", steps=[step])
    if not len(row):
        return None
    values = row.to_numpy()[0][mine]
    ran = ~(values < 0)  # (-1: that call did not run; NaN: it ran, and held NaN)
    bad = np.flatnonzero(ran & ~np.isfinite(values))
    if ran.sum() < 2 or not bad.size:
        return None
    return int(sites["call"].to_numpy()[mine[bad[0]]]), int(ran.sum())


def _forward_birth(rt: RankTrace, m: _FirstBadStep) -> str:
    name = rt.module_names[m.origin] or "(the model's own forward)"
    who = f"{name} ({rt.module_types[m.origin]})"
    call = _origin_call(rt, m.origin, m.step)
    if call is not None:  # (a reused module: one of its calls made it; past the last site, which)
        k, n = call
        who += (f", its {ordinal(k + 1)} call of {n} in the step," if k < MAX_SITE_CALLS - 1 else
                f", its {ordinal(k + 1)} call or a later one (of {n} or more in the step),")
    if not _chained(rt, m) and not m.loss_bad and m.grad_bad.any():
        # (a -Inf that the layers after it hid in the forward: a GRU's saturated gates)
        return (f"{who} made -Inf/Inf from finite inputs at step {m.step} (a log or a division of 0?); "
                f"the layers after it kept the forward and the loss finite, and the backward made NaN/Inf of it "
                f"({len(np.flatnonzero(m.grad_bad))} parameter(s) with NaN/Inf gradients)")
    if not _chained(rt, m):
        return (f"NaN/Inf was born in the forward pass of {who} at step {m.step}: its "
                f"output was non-finite while its inputs were finite")
    cname = rt.module_names[m.consumer] or "(the model's own forward)"
    return (f"{who} made -Inf from finite inputs at step {m.step} (a log or a "
            f"division of 0?), and {cname} ({rt.module_types[m.consumer]}), which took it in, "
            f"turned it into NaN/Inf")


def _backward_birth(rt: RankTrace, m: _FirstBadStep, from_above: bool) -> tuple[list[str], str]:
    bad_params = np.flatnonzero(m.grad_bad)
    first = int(bad_params.max())  # backward reaches the last-defined parameters first
    forward = f"the forward pass of step {m.step} was finite" if m.checked else f"the loss of step {m.step} was finite"
    what = (f"{forward} but the gradient of {rt.param_names[first]} went non-finite "
            f"({len(bad_params)} parameter(s) with NaN/Inf gradients)")
    if from_above:
        what += (f", every one of them: it came into the backward pass at {rt.param_names[first]} or "
                 f"above it, from the loss function's backward or an operation after the last layer"
                 f"{_loss_ops.clause(m.ops, False)}")
    return [rt.param_names[first]], what


def _entered_at_outputs(rt: RankTrace, i: int, grad_bad: np.ndarray) -> bool:
    """Every parameter that had a gradient at row i got a NaN/Inf one (a NaN born inside the
    model's backward leaves the parameters after it, which backward reached first, finite)."""
    norms = rt.param_stat("grad_norm", rows=[i]).to_numpy()[0]
    had = grad_bad | np.isfinite(norms)
    return bool(had.sum() >= 1 and grad_bad[had].all())
