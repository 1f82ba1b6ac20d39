"""Many-rank jobs: the heartbeat that says what a rank does once steps stop coming, replica
fingerprints, each DDP rank's own gradient before the all-reduce, and sharded (FSDP2, DTensor)
parameters measured by their local shard."""
