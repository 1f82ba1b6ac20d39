"""Detector thresholds: named, with their defaults and where each default comes from."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ExplodingGradientsConfig:
    # Early baseline: median total gradient norm over the first finite steps of the run
    # (10% of the run, at least 5 and at most 50 steps).
    baseline_min_steps: int = 5
    baseline_max_steps: int = 50
    # Sustained: the trailing median over `window` steps exceeds the baseline this many times.
    # Two orders of magnitude: on our healthy sample traces the total gradient norm stays within
    # ~10x of its early median (measured; see README's table), while a learning rate too high
    # passes 100x within a few steps of the divergence (Pascanu et al. 2013 describe the blow-up).
    sustained_ratio: float = 100.0
    window: int = 5
    # A single-step jump this many times the baseline, not sustained, is reported as a warning.
    spike_ratio: float = 1000.0
    # Dating: an event began where the norm first stood `onset_factor` x above the median of the
    # `pre_window` healthy steps before it (and stayed so); the parameters named grew most there.
    # 30x, an order and a half of magnitude: tuned on the tuning half, whose oracles date a ramp
    # of ~3x a step at its 10x or its 100x crossing (within 2 steps of both).
    onset_factor: float = 30.0
    pre_window: int = 50
    # Present from the first steps, judged across depth (see detectors/_exploding_at_init.py).
    # Backward: the first third of the weights' gradient RMS over the last third's, median of
    # the first `depth_steps` steps; two orders of magnitude, as `sustained_ratio` (the
    # vanishing detector's mirror). Healthy corpus runs stay under ~30.
    depth_ratio: float = 100.0
    depth_steps: int = 5
    # Forward: on the first watched step, `chain_layers` or more successive weighted layers'
    # outputs each at least `layer_gain` x the one before, `activation_growth` x in all (He et
    # al. 2015: a gain g per layer multiplies the signal by g^depth). Healthy corpus runs: <4x.
    activation_growth: float = 100.0
    layer_gain: float = 1.5
    chain_layers: int = 4


@dataclass(frozen=True)
class VanishingGradientsConfig:
    # Ratio of the gradient RMS of the earliest weight matrices to that of the last ones. Below
    # 1e-3 (three orders of magnitude) the early layers effectively stop learning; healthy sample
    # traces (MLP/ReLU) stay above 1e-1 (measured), a 12-layer sigmoid MLP falls below 1e-5
    # (Glorot & Bengio 2010 measured the same decay through sigmoid layers).
    ratio: float = 1e-3
    # Absolute floor: an early-layer weight gradient RMS below this is "near zero" in float32.
    near_zero_rms: float = 1e-10
    # Judged over the last quarter of the run (at least `min_window` steps) so a slow start
    # does not count; the onset is where the trailing median of the ratio first falls below.
    window_frac: float = 0.25
    min_window: int = 5
    onset_window: int = 5


@dataclass(frozen=True)
class NonfiniteConfig:
    pass


@dataclass(frozen=True)
class LossDivergenceConfig:
    # Trailing median over this many steps smooths batch-to-batch noise before comparing losses;
    # the first full window is the warm-up (no verdict before it). 20: with 10, the lowest of the
    # medians of a very noisy loss (batch of 1, chi-square noise) sits 3x below its typical
    # level (simulated); with 20 and the noise test below no simulated noisy run is flagged.
    window: int = 20
    # Diverged: the smoothed loss rises above this many times its best (lowest smoothed) value so
    # far. healthy_mlp's never exceeds 1.2x its running minimum (measured); a language model that
    # diverges climbs from ~2.5-3.5 towards ln(vocab) ~ 10.8, i.e. 3-4x.
    rise_ratio: float = 2.0
    # ... and that rise undoes at least this share of the progress made since the first window
    # ((now - best) / (start - best)), so a loss near zero doubling from 1e-3 to 2e-3 stays quiet.
    # 0.25: healthy_mlp's worst bump undoes 2% (measured).
    min_progress_lost: float = 0.25
    # ... and exceeds this many times the per-step noise of the loss (1.4826 x the median
    # absolute deviation from the trailing median). 2.5: no false warning on 20 simulated flat or
    # decaying runs each of chi-square(1), exponential and log-normal(sigma 2) noise, 100 to
    # 20,000 steps; a 3x rise under 30% noise is always caught (simulated).
    min_rise_in_noise: float = 2.5
    # Still up at the end of the run: an error (rather than a warning) when the smoothed loss ends
    # this many times above its best and above where it started: worse than the untrained model.
    error_ratio: float = 100.0

    def __post_init__(self):
        _check(self, window=(2, None), rise_ratio=(1.0, None), min_progress_lost=(0.0, None),
               min_rise_in_noise=(0.0, None), error_ratio=(1.0, None))


@dataclass(frozen=True)
class LossPlateauConfig:
    # The judged stretch: the last `tail_frac` of the run, and no verdict when it has fewer than
    # `min_tail_steps` steps (a plateau is a long stretch).
    tail_frac: float = 0.5
    min_tail_steps: int = 50
    # Plateau: the median loss of the stretch's last fifth (`edge_frac`) differs from that of its
    # first fifth by less than this share. healthy_mlp (Adam 1e-3, constant) still improves by
    # 15% over its last half (measured); vanishing_sigmoid, stuck at ln 4, changes by < 1%.
    min_improvement: float = 0.05
    edge_frac: float = 0.2

    def __post_init__(self):
        _check(self, tail_frac=(0.0, 1.0), min_tail_steps=(2, None), min_improvement=(0.0, None),
               edge_frac=(0.0, 0.5))


@dataclass(frozen=True)
class UpdateRatioConfig:
    # Update-to-weight ratio ||dw|| / ||w|| of one optimizer step. "Somewhere around 1e-3" is
    # healthy (Karpathy, CS231n "Neural Networks Part 3": ratio of weights:updates); healthy_mlp's
    # weight matrices sit at 1e-3 - 3e-3 over its last half, 1e-2 at step 0 (measured).
    # Too large: two orders of magnitude above 1e-3; the learning rate is too high.
    too_large: float = 1e-1
    # Too small: three orders below 1e-3, for weights that receive gradients; they barely move.
    # float32 cannot even represent an update below ~6e-8 of a weight (machine epsilon 1.2e-7).
    too_small: float = 1e-6
    # Judged on the median over the last `window_frac` of the sampled updates that are finite
    # (at least `min_samples`): early steps (the first ~50 in healthy_mlp) are larger.
    window_frac: float = 0.5
    min_samples: int = 3
    # The onset is where the trailing median over this many samples first crossed the threshold.
    onset_samples: int = 3
    # Only weights of this many dimensions or more (matrices, kernels, embeddings): biases
    # start at 0 and their ratio is huge or meaningless; norm gains barely move by design.
    min_ndim: int = 2
    # Weights whose RMS (||w|| / sqrt(numel)) is below this at the first recorded step are skipped
    # (zero-initialised, e.g. LoRA B or zero-init residual projections: their ratio is relative
    # to ~0), and so are samples where it is below. Default inits put RMS near 1/sqrt(3 fan_in),
    # above 2e-3 up to fan_in 65536.
    min_weight_rms: float = 1e-4

    def __post_init__(self):
        _check(self, too_large=(0.0, None), too_small=(0.0, None), window_frac=(0.0, 1.0),
               min_samples=(1, None), onset_samples=(1, None), min_ndim=(0, None),
               min_weight_rms=(0.0, None))
        if not self.too_small < self.too_large:
            raise ValueError(f"too_small ({self.too_small!r}) must be below too_large ({self.too_large!r})")


def _check(cfg, **bounds) -> None:
    """ValueError naming the field when a threshold lies outside [lo, hi] (None: unbounded)."""
    for name, (lo, hi) in bounds.items():
        v = getattr(cfg, name)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            want = (f">= {lo}" if hi is None else f"between {lo} and {hi}")
            raise ValueError(f"{name} must be {want}, got {v!r}")


@dataclass(frozen=True)
class DeadReluConfig:
    # Share of a layer's units that never output a positive value during the latest window
    # (activity_window steps, 50 by default). Healthy ReLU nets keep some dead units: 5-20% in
    # our healthy sample traces (measured) and in Lu et al. 2019 ("Dying ReLU and
    # initialization"); half or more of a layer is a layer that has mostly stopped learning.
    warning_share: float = 0.5
    error_share: float = 0.9
    # Layers narrower than this are not judged: 3 dead units of 4 is noise, not a trend.
    min_units: int = 8
    # A unit counts as dead only if its site ran in at least this share of the window's steps.
    min_seen_share: float = 0.5


@dataclass(frozen=True)
class AttentionCollapseConfig:
    # Entropy collapse (Zhai et al. 2023, "Stabilizing Transformer Training by Preventing
    # Attention Entropy Collapse"): a layer's mean normalised row entropy below this. Single
    # low-entropy heads are often healthy specialists (previous-token heads), so the layer's
    # mean is judged, from the first sampled step on (near one-hot at initialisation is broken).
    entropy: float = 0.1
    # All mass on one key position: every head of the layer puts more than this share of its
    # attention on its single most-attended key (healthy heads with a sink stay below; the
    # StreamingLLM sink heads put ~50-80% there).
    sink_share: float = 0.95
    # Heads alike: mean pairwise cosine similarity of the heads' maps above this while the
    # layer is also sharp (mean entropy below `alike_entropy`); at initialisation every head is
    # near-uniform and therefore alike, which is not a collapse.
    similarity: float = 0.99
    alike_entropy: float = 0.5
    # The condition must hold on the last this-many sampled steps.
    min_samples: int = 2


@dataclass(frozen=True)
class MemoryLeakConfig:
    # Warm-up excluded from the fit: allocator pools, lazy initialisation and the first
    # optimizer state make memory climb early in every run.
    warmup_frac: float = 0.2
    min_steps: int = 30
    # Growth over the analysed span that counts: at least this many bytes and this share of the
    # memory at its start. (glibc and the CUDA caching allocator move RSS/reserved by a few MB
    # on healthy runs; measured on the sample traces.)
    min_growth_bytes: float = 16 * 2**20
    min_growth_share: float = 0.05
    # Steady: a straight line explains the growth (R^2) and the last third still grows at this
    # share of the overall slope (a plateau does not).
    min_r2: float = 0.8
    min_tail_slope_share: float = 0.5
    # One-off jump: a single step holds this share of the whole growth.
    jump_share: float = 0.5
    # Tensors holding an autograd graph, counted by the census: a leak even before memory shows
    # it when they grow by at least this many per step, this many in all, over this many
    # censuses (healthy sample runs hold exactly 1, the step's loss, at every census; a kept
    # loss adds 1 per step).
    graph_min_per_step: float = 0.5
    graph_min_growth: int = 50
    graph_min_censuses: int = 4


@dataclass(frozen=True)
class DataloaderBottleneckConfig:
    # Share of the step's wall time spent waiting for the next batch (median over the run after
    # `skip_steps`). A healthy input pipeline keeps the GPU/CPU fed with a few percent of wait;
    # PyTorch's performance tuning guide and HTA's idle-time analysis treat a data-bound step as
    # the first thing to fix. 30% (our measurement: the healthy sample traces wait under 5%).
    share: float = 0.3
    skip_steps: int = 5  # the first batches wait for worker start-up
    min_steps: int = 20


@dataclass(frozen=True)
class SlowStepsConfig:
    # A step slower than this many times the median step, and by at least `min_excess_s`, is an
    # outlier worth a look (below 50 ms, OS scheduling and garbage collection on a shared
    # machine make millisecond steps jitter by several times; measured on this project's CI).
    ratio: float = 3.0
    min_excess_s: float = 0.05
    min_steps: int = 20
    max_listed: int = 10


@dataclass(frozen=True)
class SaturationConfig:
    # Share of a tanh/sigmoid's outputs within 1% of its bounds (|tanh| > 0.99, sigmoid < 0.005
    # or > 0.995) over the latest activity window. There the derivative is below 0.02: those
    # units barely learn (LeCun et al. 1998, "Efficient BackProp", on keeping tanh inputs in
    # its linear range; Glorot & Bengio 2010 saw the top sigmoid layer saturate). Healthy tanh
    # layers in our tests stay under 10% (measured).
    share: float = 0.5


@dataclass(frozen=True)
class HostDeviceCopiesConfig:
    # Share of the profiled steps' wall time spent in host<->device copies (CUDA "Memcpy HtoD" /
    # "Memcpy DtoH" device time). A fed GPU copies each batch once, a few percent of a step;
    # copies that take a fifth of the step point at tensors moved back and forth (.cpu(),
    # .item(), .numpy(), pageable memory) — HTA's memory-bandwidth analysis flags the same.
    share: float = 0.2


@dataclass(frozen=True)
class OutOfMemoryConfig:
    # How many allocation sites / tensor groups the finding lists, and how many frames of the
    # line that raised the error (enough to name the layer, short enough for a ticket).
    max_listed: int = 5
    max_frames: int = 4


@dataclass(frozen=True)
class LossZeroConfig:
    # A loss of exactly 0.0 on this share of the first `first_steps` steps, or of the steps before
    # the loss first went non-finite, is a warning (see detectors/loss_zero.py). Half: a bug
    # zeroes every step (a mask that keeps nothing) or most of them before it breaks.
    min_share: float = 0.5
    first_steps: int = 20

    def __post_init__(self):
        _check(self, min_share=(0.0, 1.0), first_steps=(1, None))


@dataclass(frozen=True)
class RunawayOutputsConfig:
    # Before the first NaN/Inf: the output layer's max |output| over the `window` steps before
    # it at least `ratio` x (an order of magnitude) the median of the `baseline_samples` watched
    # steps before that (see detectors/runaway_outputs.py).
    ratio: float = 10.0
    window: int = 20
    baseline_samples: int = 5

    def __post_init__(self):
        _check(self, ratio=(1.0, None), window=(1, None), baseline_samples=(1, None))


@dataclass(frozen=True)
class LossScaleConfig:
    # torch.amp.GradScaler's defaults: init_scale 2^16, backoff 0.5 per overflow, growth 2x after
    # growth_interval=2000 clean steps. Below a scale of 1 the unscaled gradients overflow fp16
    # (or are NaN) themselves: no scale can help.
    min_scale: float = 1.0
    # After the start-up, one overflow is one halving: 5 in a row means the gradients grew 32x
    # past what fp16 holds within a few steps (healthy fp16 runs of ours skip 1 at a time).
    consecutive_skips: int = 5
    # A fall of 2^10 below the highest scale after the start-up: gradients 1000x larger.
    max_drop: float = 1024.0


@dataclass(frozen=True)
class AnalysisConfig:
    exploding_gradients: ExplodingGradientsConfig = field(default_factory=ExplodingGradientsConfig)
    vanishing_gradients: VanishingGradientsConfig = field(default_factory=VanishingGradientsConfig)
    nonfinite: NonfiniteConfig = field(default_factory=NonfiniteConfig)
    loss_divergence: LossDivergenceConfig = field(default_factory=LossDivergenceConfig)
    loss_plateau: LossPlateauConfig = field(default_factory=LossPlateauConfig)
    loss_zero: LossZeroConfig = field(default_factory=LossZeroConfig)
    runaway_outputs: RunawayOutputsConfig = field(default_factory=RunawayOutputsConfig)
    update_ratio: UpdateRatioConfig = field(default_factory=UpdateRatioConfig)
    dead_relu: DeadReluConfig = field(default_factory=DeadReluConfig)
    attention_collapse: AttentionCollapseConfig = field(default_factory=AttentionCollapseConfig)
    memory_leak: MemoryLeakConfig = field(default_factory=MemoryLeakConfig)
    dataloader_bottleneck: DataloaderBottleneckConfig = field(default_factory=DataloaderBottleneckConfig)
    slow_steps: SlowStepsConfig = field(default_factory=SlowStepsConfig)
    saturation: SaturationConfig = field(default_factory=SaturationConfig)
    host_device_copies: HostDeviceCopiesConfig = field(default_factory=HostDeviceCopiesConfig)
    out_of_memory: OutOfMemoryConfig = field(default_factory=OutOfMemoryConfig)
    loss_scale_collapse: LossScaleConfig = field(default_factory=LossScaleConfig)
