"""The tensors a trace keeps whole and the bad step's forensics: the black box (the model just
before it broke), parameter snapshots and sampled tensors, the replay of a bad step on a copy of
the model, where a NaN/Inf was born and what the loss function did."""
