"""The step's samplers on the device: counter-hash randomness and top-k/top-p (stage 11), and
speculative decoding's rejection rule and verifier (stage 12). Each module sits in its own
import layer (pyproject.toml). The request's parameters and stage 00's CPU sampler, which the
plain data types need, stay in nanoserve/sampling.py.
"""
