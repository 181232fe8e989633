"""The trainer process: model, loss terms, the optimizer step, checkpoints and weight publishing."""
