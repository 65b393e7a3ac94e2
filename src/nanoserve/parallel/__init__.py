"""Tensor parallelism (stage 09, planned): process groups, workers, a control channel."""
