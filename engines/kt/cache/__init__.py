"""The paged caches' bookkeeping every family's caches live in: the block pool, page tables and prefix hashes."""
