"""How measurements are reduced on the device and brought to the host: the per-tensor statistics
and the step's one transfer (stats.py), the fused reductions of a watched step on a GPU (fused.py),
and the fixed-bin histograms (histograms.py)."""
