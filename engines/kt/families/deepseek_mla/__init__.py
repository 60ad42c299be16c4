"""DeepSeek V2 / V3 (MLA attention, a latent KV cache): what the KT engine knows of that generation, which V3.2
(engines/kt/families/deepseek_v32/) builds on.

* family.py        the family object (engines/kt/families/base.py): architectures served, default rule files
* load.py          `load_mla`: build on the meta device, place by the rules, stream the checkpoint (BF16, FP8 or
                   GGUF), the latent KV cache and the MTP draft head; `MLAVariant`: what a later generation changes
(what the start-up log says of the GPU's share of the routed experts, shared with V4: engines/kt/experts/notes.py)
"""
