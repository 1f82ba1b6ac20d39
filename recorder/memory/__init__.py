"""The job's memory: the probe asked once a step (memory_probe.py), the readings that cost no
device synchronisation and the tensor census (readings.py), and the CUDA caching allocator's own
record: history, snapshots, out-of-memory (cuda_allocator.py)."""
