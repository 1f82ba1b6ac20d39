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

from ..findings import Finding
from ..trace import RankTrace, measured_rows
from . import _loss_ops


@dataclass(frozen=True)
class NonfiniteConfig:
    pass


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
    steps = rt.steps
    idx = rt.step_index
    loss = steps["loss"].to_numpy()
    origin = steps["nonfinite_origin"].to_numpy()
    batch_bad = steps["batch_nonfinite"].to_numpy() > 0
    d = rt.digest
    # Counts, not norms: an Inf norm can be an overflow of finite gradients.
    # NaN also stands for "no loss passed to rec.step() on this step": a NaN loss counts when the
    # trace says a loss was given (cross_entropy with every target ignored is 0/0 = NaN with
    # gradients of exactly 0), or, in traces that do not say, when the backward was non-finite too.
    given = steps["loss_given"].to_numpy()
    loss_bad = np.isinf(loss) | (np.isnan(loss) & ((given == 1) | d.grad_nonfinite))
    any_bad = loss_bad | (origin >= 0) | batch_bad | d.grad_nonfinite | d.param_nonfinite
    bad_rows = np.flatnonzero(any_bad)
    if not bad_rows.size:
        return []
    i = int(bad_rows[0])
    # The first bad step's own rows: that is all of the steps x tensors tables it needs.
    g_bad = rt.param_stat("grad_nonfinite", rows=[i]).to_numpy()[0]
    grad_bad = g_bad > 0
    w_bad = ~np.isfinite(rt.param_stat("param_norm", rows=[i]).to_numpy()[0])
    step = int(idx[i])
    n_bad_steps = int(any_bad[i:].sum())
    evidence = {
        "first_step": step,
        "nonfinite_steps_after": n_bad_steps,
        "steps_recorded_after": int(len(idx) - i),
        "loss_at_step": float(steps["loss"].iloc[i]),
        "loss_before": float(steps["loss"].iloc[i - 1]) if i > 0 else None,
        "total_grad_norm_before": float(rt.total_grad_norm.iloc[i - 1]) if i > 0 else None,
    }
    mods_bad = rt.module_stat(rows=[i]).to_numpy()[0]
    checked = bool(measured_rows(mods_bad))  # -1 everywhere: not checked
    bad_modules = [rt.module_names[j] for j in np.flatnonzero(~np.isfinite(mods_bad))]
    evidence["modules_with_nonfinite_output"] = len(bad_modules)
    bad_params = np.flatnonzero(grad_bad)
    evidence["params_with_nonfinite_grad"] = {rt.param_names[j]: int(g_bad[j]) for j in bad_params[:20]}

    # 1: the gradient at the model's outputs was NaN/Inf (measured on a watched step, or told by
    # the replay's backward); 0: it was finite, the model's backward made it; -1: not known.
    out_grad = int(steps["output_grad_nonfinite"].iloc[i])
    from_above = False  # (backward) every gradient went bad: it came in at the outputs or above
    # The loss function on this step, read by the recorder from its graph (loss_graph.py):
    # whether the model's own outputs were finite, and the loss's ops.
    check = rt.loss_checks.get(step, {})
    outs_bad, ops = check.get("outputs_nonfinite", -1), check.get("ops")
    if ops is not None:
        evidence["loss_ops"] = ops
    if outs_bad != -1:
        evidence["outputs_nonfinite_on_step"] = bool(outs_bad)
    if batch_bad[i]:
        stage, where = "batch", []
        what = f"the input batch of step {step} already held NaN/Inf"
    elif origin[i] >= 0:
        stage, where = "forward", [rt.module_names[origin[i]]]
        name = rt.module_names[origin[i]] or "(the model's own forward)"
        mtype = rt.module_types[origin[i]]
        what = (f"NaN/Inf was born in the forward pass of {name} ({mtype}) at step {step}: its "
                f"output was non-finite while its inputs were finite")
        evidence["origin_module_output_absmax"] = float(mods_bad[origin[i]])
        consumer = int(steps["nonfinite_consumer"].iloc[i])
        if 0 <= consumer < len(rt.module_names) and consumer != origin[i]:
            # The origin made a -Inf (a log of 0, say), which the consumer turned into NaN/+Inf.
            cname = rt.module_names[consumer] or "(the model's own forward)"
            what = (f"{name} ({mtype}) made -Inf from finite inputs at step {step} (a log or a "
                    f"division of 0?), and {cname} ({rt.module_types[consumer]}), which took it in, "
                    f"turned it into NaN/Inf")
            evidence["chain"] = {"producer": rt.module_names[origin[i]], "consumer": rt.module_names[consumer],
                                 "step": step}
    elif loss_bad[i] and not checked and outs_bad == 0:
        # Modules not checked, but the model's outputs themselves were, on the step itself.
        stage, where = "loss", []
        what = (f"the model's outputs were finite at step {step} (checked on the step itself) but the loss was "
                f"{steps['loss'].iloc[i]}: the loss function made it{_loss_ops.clause(ops, True)}")
    elif loss_bad[i] and not checked:
        stage, where = "unchecked", []
        what = (f"the loss was {steps['loss'].iloc[i]} at step {step}, a step whose module outputs were not "
                f"checked (the recorder watches every module on sampled steps, and its replay of this step "
                f"on a copy of the model did not reproduce the NaN/Inf)")
        what += ("; the model's outputs already held NaN/Inf on that step" if outs_bad == 1
                 else _loss_ops.clause(ops, True))
    elif loss_bad[i]:
        stage, where = "loss", []
        what = (f"every module output was finite at step {step} but the loss was {steps['loss'].iloc[i]}"
                f"{_loss_ops.clause(ops, True)}")
    elif bad_params.size and out_grad == 1:
        # The gradient arriving at the model's outputs was NaN/Inf already: born in the backward
        # of the loss, outside the model (sqrt/norm of 0, log(0) in a hand-written loss).
        stage, where = "loss_backward", []
        what = (f"the forward pass and the loss of step {step} were finite, but the gradient the loss sent "
                f"back to the model's outputs was already NaN/Inf: it was born in the loss function's backward "
                f"({len(bad_params)} parameter(s) got NaN/Inf gradients from it){_loss_ops.clause(ops, False)}")
    elif bad_params.size:
        first = int(bad_params.max())  # backward reaches the last-defined parameters first
        stage, where = "backward", [rt.param_names[first]]
        forward = f"the forward pass of step {step} was finite" if checked else f"the loss of step {step} was finite"
        what = (f"{forward} but the gradient of {rt.param_names[first]} went non-finite "
                f"({len(bad_params)} parameter(s) with NaN/Inf gradients)")
        from_above = out_grad == -1 and _entered_at_outputs(rt, i, grad_bad)
        if from_above:
            # Every gradient, the ones backward reaches first included: the NaN/Inf came in at or
            # above the last layer. This step did not tell whether the gradient at the outputs
            # was already non-finite (a watched step, or the replay's backward, would).
            what += (f", every one of them: it came into the backward pass at {rt.param_names[first]} or "
                     f"above it, from the loss function's backward or an operation after the last layer"
                     f"{_loss_ops.clause(ops, False)}")
    else:
        bad_w = np.flatnonzero(w_bad)
        stage, where = "optimizer", [rt.param_names[j] for j in bad_w[:5]]
        what = (f"gradients at step {step} were finite but {len(bad_w)} parameter(s) went non-finite "
                f"in the optimizer update")
    evidence["stage"] = stage
    summary = (f"First NaN/Inf at step {step}: {what}; "
               f"{n_bad_steps} of the {len(idx) - i} steps recorded from then on are non-finite.")
    advice = _ADVICE[stage]
    if stage in ("loss", "loss_backward") or (stage == "backward" and from_above):
        advice = _loss_ops.advice(ops) + advice
    return [Finding(KIND, "error", step, where, summary, evidence, advice)]


def _entered_at_outputs(rt: RankTrace, i: int, grad_bad: np.ndarray) -> bool:
    """Every parameter that had a gradient at row i got a NaN/Inf one (a NaN born inside the
    model's backward leaves the parameters after it, which backward reached first, finite)."""
    norms = rt.param_stat("grad_norm", rows=[i]).to_numpy()[0]
    had = grad_bad | np.isfinite(norms)
    return bool(had.sum() >= 1 and grad_bad[had].all())
