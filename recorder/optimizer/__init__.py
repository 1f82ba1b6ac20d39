"""Around the optimizer step: the gradient norms taken before it, the update guard that fires the
black box on a NaN/Inf gradient, the per-parameter statistics of the update, the optimizer's
schedule (learning rates, hyper-parameters, AMP's loss scale), and the one global pre-hook and
post-hook that every Recorder shares (global_hooks.py)."""
