"""The loop and the scheduler: validate and queue requests, then step = schedule, run, finish.

Stage 00's engine and scheduler (every stage steps through them), stage 11's overlapped loop
and the --trace record of each step. No tensors live here.
"""
