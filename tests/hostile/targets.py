"""What the mutators of mutations.py put into a trace, and where: hostile payloads, the
datasets that hold step numbers, indices, JSON and names, and one valid CUDA memory snapshot
(the CPU samples' memory tables are empty, so the memory classes add it first)."""

# Markup the reports must escape: the checker (run_cli.py) looks for these exact raw forms.
SCRIPT = "<script>alert(1)</script>"
IMG = "<img src=x onerror=alert(2)>"
ATTR = 'x" onmouseover="alert(3)'
MD_LINK = "a | b `code` [click](javascript:alert(4)) **bold**"
PAYLOADS = [SCRIPT, IMG, ATTR, MD_LINK,
            "\x1b[31mred\x1b[0m", "\x1b]8;;http://evil.example\x1b\\click\x1b]8;;\x1b\\",  # CSI, OSC 8
            "bell\x07", "over\rwrite", "c1\x9b31m", "line1\nline2", "tab\there", "\u202eevil.exe",
            "L" * 100_000, "", b"bad\xff\xfe\xc3(utf8"]  # the last is not UTF-8
LONG_INT = "9" * 5000  # json.loads refuses more than 4300 digits (ValueError)
DEEP_JSON = "[" * 100_000  # json.loads recurses: RecursionError
# Where step numbers live, and columns that index, count or size something.
STEP_DATASETS = ["steps/step", "activations/step", "updates/step", "attention/step", "histograms/step",
                 "activity/step_start", "activity/step_end", "activity_sites/first_step", "tensors/step",
                 "snapshots/step", "blackbox/step", "census_groups/step", "profile_windows/step_start",
                 "profile_windows/step_end", "attention_sites/first_step", "oom_events/step"]
INDEX_DATASETS = ["activity_sites/units", "activity_sites/bit_offset", "activity_sites/module",
                  "activity_sites/unit_dim", "attention_sites/heads", "attention_sites/head_offset",
                  "attention_sites/module", "profile_windows/trace_offset", "profile_windows/trace_nbytes",
                  "profile_windows/window", "profile_ops/window", "tensors/offset", "tensors/nbytes",
                  "snapshots/offset", "snapshots/nbytes", "snapshots/slot", "snapshots/crc32",
                  "histogram_params/param", "histogram_modules/module", "module_outputs/module",
                  "steps/nonfinite_origin", "census_groups/count", "census_groups/bytes", "params/numel",
                  "oom_events/snapshot", "activity/steps_watched", "attention/keys"]
JSON_TEXTS = ["params/shape", "tensors/shape", "blackbox/detail", "module_outputs/shape", "census_groups/shape"]
NAME_LISTS = ["params/name", "modules/name", "params/shape", "params/numel", "params/dtype", "modules/type",
              "modules/is_leaf", "histogram_params/param", "histogram_modules/module"]
PER_STEP = ["steps/step", "params/grad_norm", "params/grad_absmax", "params/grad_nonfinite",
            "params/param_norm", "modules/output_absmax"]


# -- CUDA memory snapshot tables (empty in the CPU samples: one valid snapshot is added first) -----
MEMORY_ROWS = {
    "memory_snapshots": dict(snapshot=[0], step=[5], reason=["oom"], time_s=[1.0], device=[0],
                             allocated_bytes=[1 << 20], reserved_bytes=[2 << 20], n_device_traces=[1],
                             allocator_settings=['{"expandable_segments": false}'], keys=[3], extra=[""]),
    "memory_segments": dict(snapshot=[0], device=[0], address=[1 << 40], total_size=[2 << 20],
                            allocated_size=[1 << 20], active_size=[1 << 20], requested_size=[1 << 20],
                            stream=[0], segment_type=["large"], pool_a=[0], pool_b=[0], is_expandable=[0],
                            stack=[0], keys=[0xFFF], extra=[""]),
    "memory_blocks": dict(snapshot=[0, 0], segment=[0, 0], address=[1 << 40, (1 << 40) + (1 << 20)],
                          size=[1 << 20, 1 << 20], requested_size=[1 << 20, 0],
                          state=["active_allocated", "inactive"], stack=[0, -1], keys=[0x1F, 0x0F], extra=["", ""]),
    "memory_trace": dict(snapshot=[0] * 3, device=[0] * 3, action=["segment_alloc", "alloc", "oom"],
                         addr=[1 << 40, 1 << 40, -1], device_free=[-1, -1, 1 << 20], size=[2 << 20, 1 << 20, 8 << 20],
                         stream=[0] * 3, time_us=[1, 2, 3], compile_context=[""] * 3, user_metadata=[""] * 3,
                         stack=[0, 0, 0], keys=[0x1FB, 0x1FB, 0x1FD], extra=[""] * 3),
    "memory_frames": dict(filename=["/home/u/train.py", "/usr/lib/torch/nn/linear.py"], line=[31, 125],
                          name=["forward", "forward"], keys=[7, 7], extra=["", ""]),
    "memory_stacks": dict(first=[0], length=[2]),
    "memory_stack_frames": dict(frame=[0, 1]),
}
