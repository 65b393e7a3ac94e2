"""`nanoserve bench`: the workload, nanoserve's runs (run.py) and transformers' (hf.py)."""
