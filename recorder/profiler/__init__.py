"""torch.profiler windows on a sparse schedule (profile_windows.py) and each window's table of
operators (op_table.py), with the recorder's own work in one row of its own."""
