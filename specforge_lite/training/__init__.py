"""Training: the loop, optimizer and schedule, atomic checkpoints with exact resume, tracking."""
