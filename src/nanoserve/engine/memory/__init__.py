"""K/V memory bookkeeping: the block allocator, block tables and every stage's cache manager.

Stage 01's slabs, 02's allocator, 03's tables, 04's block manager and 07's prefix cache. They
decide where a sequence's K/V lives and write that (seq.block_table, seq.slab_id), nothing else.
"""
