"""The control plane, one folder per job, each using only the folders below it.

- speculation/: stage 12, the proposers, the verify step, guesses added and rolled back
- loop/: the engine loop and the scheduler (stage 00 on; stage 11's overlap)
- runner/: one step's inputs, the model run, sampling; graphs and the device batch
- memory/: the allocator, block tables and every stage's cache manager
"""
