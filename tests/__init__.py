"""Cross-stage tests: HF parity, equivalence chain, scheduler, faults, harness self-tests."""
