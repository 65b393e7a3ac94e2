"""The loop and the scheduler: validate and queue requests, then step = schedule, execute,
update, for every stage; and the --trace record of each step. No tensors live here.
"""
