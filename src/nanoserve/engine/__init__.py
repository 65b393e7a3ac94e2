"""The control plane (sequences, scheduler, block manager) and the loop that drives the model."""
