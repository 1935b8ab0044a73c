"""A run's stages: the prompt baseline, the training loop and its checkpoints, the run folder, sweeps, the
report."""
