"""Training: one accelerate loop for every speculator family, checkpoints and tracking."""
