"""DeepSeek V2 / V3 (MLA attention, a latent KV cache): what the KT engine knows of that generation, which V3.2
(engines/kt/families/deepseek_v32/) builds on.

* family.py        the family object (engines/kt/families/base.py): architectures served, default rule files, and
                   its hooks in the one load pipeline (engines/kt/build.py): the checkpoint's layers, the weights,
                   fused norms, the MTP draft head, the latent KV cache and the runner over it, decode graphs
* load.py          what those hooks use: the draft layer, kt-kernel's pre-converted experts, the weight cache folder,
                   the tensors a checkpoint does not carry
* runner.py        the KT runner: a step's sequences as one batch of rows over the paged latent cache
* attention.py     MLA over that cache (absorbed decode, expanded prefill) and the step metadata it reads
* kv_cache.py      the latent cache's pages, on the core's block pool (engines/kt/cache/block_pool.py)
* flashinfer.py    FlashInfer's paged MLA, where it attends
* graphs.py        decode steps captured in CUDA graphs, per bucket of batch and context
* mtp.py           the multi-token-prediction layer as a draft head (engines/kt/drafting.py runs it)
(what the start-up log says of the GPU's share of the routed experts, shared with V4: engines/kt/experts/notes.py)
"""
