"""Every attention backend: the torch oracle and torch paths (00-04), Triton kernels (05-06)."""
