"""Speculative decoding (stage 12): the policy the scheduler plans guesses with (budgets and the
back-off), and the proposers the runner calls (n-gram lookup, a draft model).
"""
