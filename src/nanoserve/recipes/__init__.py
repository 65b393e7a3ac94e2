"""Stage recipes: what the engine of each stage is made of, one module per stage.

`recipes/<slug>.py` (the stage's stem without its number: `paged_pool.py` for `04_paged_pool`)
holds that stage's `RECIPE`: a plain `build` function that makes the stage's cache manager, KV
cache, input packer and attention backend, reading top to bottom, plus the learner API (the names
the stage's starter defines, and where each reference lives) and the parts a learner may replace
through `components=`. `assemble.build_engine` finds the recipe by the stage's stem, so a
new stage adds its module here and its row in `nanoserve/stages.py`, and touches nothing else.
"""
