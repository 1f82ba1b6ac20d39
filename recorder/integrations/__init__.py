"""Ready integrations of the Recorder with training frameworks, one line for the user each:

    Trainer(callbacks=[TorchAutopsyCallback("runs/exp1")])     # torchautopsy.lightning,
                                                               # .pytorch_lightning, .huggingface

Each is built like the Recorder (the run directory first, the Recorder's options as keywords),
makes the Recorder when training starts and closes it when training ends. Each module imports
its framework when it is imported itself, never before: none is a dependency of torchautopsy.
"""
