"""DeepSeek V2 / V3 (MLA attention, a latent KV cache): what the KT engine knows of that generation, which V3.2
(engines/kt/families/deepseek_v32/) builds on.

* family.py        the family object (engines/kt/families/base.py): architectures served, default rule files, and
                   its hooks in the one load pipeline (engines/kt/build.py): the checkpoint's layers, the weights,
                   fused norms, the MTP draft head, the latent KV cache and the runner over it, decode graphs
* load.py          what those hooks use: the draft layer, kt-kernel's pre-converted experts, the weight cache folder,
                   the tensors a checkpoint does not carry
(what the start-up log says of the GPU's share of the routed experts, shared with V4: engines/kt/experts/notes.py)
"""
