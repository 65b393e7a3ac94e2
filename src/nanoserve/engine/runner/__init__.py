"""The model runner: one step's inputs packed, the model run, the next tokens sampled.

The input packer (stage 04), the decode graphs (stage 08), the device batch and the runner that
launches a step without waiting for it (stage 11). It makes no scheduling decisions.
"""
