"""Training: model loading, data, the run loop, checkpoints and the train CLI."""
