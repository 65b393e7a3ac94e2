"""Tensor parallelism (stage 09): the process group, the worker processes, the control channel."""
