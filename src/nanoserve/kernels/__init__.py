"""Attention math and (from stage 05) Triton kernels; the torch path here is the test oracle."""
