"""The rank file: the schema of its tables, the writer thread (all file I/O), the header written
before the first step (with where each module's code is), one file per attempt of a restarted job,
and the exit hooks that close it when the job ends without rec.close()."""
