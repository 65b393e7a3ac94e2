"""Speculative decoding (stage 12): proposers (n-gram, draft model), the verify step in one
target forward, and the loop and scheduler parts that add guesses and roll them back.
"""
