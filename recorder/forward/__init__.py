"""What the recorder sees of the model's forward: the root module's hooks of every step (its time,
the model's mode, the batch), the per-module hooks of watched steps, unit activity, attention,
and the wrapped functions (``F.relu``, SDPA, ``DataLoader.__next__``) that show calls no module
hook sees."""
