"""Attention and its caches: MLA over the paged latent cache, its block pool, and FlashInfer."""
