"""The detector registry: an explicit tuple. Each detector module has KIND, REQUIRES and
``detect(rank_trace, cfg) -> list[Finding]``, a pure function over a read-only trace."""

from . import (attention_collapse, dataloader_bottleneck, dead_relu, exploding_gradients,
               host_device_copies, loss_divergence, loss_plateau, loss_scale, loss_zero, memory_leak, nonfinite,
               out_of_memory, runaway_outputs, saturation, slow_steps, update_ratio, vanishing_gradients)

DETECTORS = (nonfinite, exploding_gradients, vanishing_gradients, dead_relu, attention_collapse,
             memory_leak, out_of_memory, saturation, loss_zero, runaway_outputs, loss_divergence, loss_plateau, update_ratio,
             dataloader_bottleneck, host_device_copies, slow_steps, loss_scale)
