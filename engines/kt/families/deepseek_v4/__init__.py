"""DeepSeek-V4 (Flash, Pro) as released: everything V4-specific the KT engine knows lives in this folder.

* names.py    the released tensor names -> transformers' `DeepseekV4ForCausalLM` modules
* loader.py   streams the checkpoint: FP8 + UE8M0 projections dequantized, MXFP4 experts handed to kt-kernel
* runner.py   the model runner: attention, indexer, hyper-connections and routing are transformers' modules;
              one V4 cache (sliding window + compressed entries) per sequence
* family.py   the family object the engine's registry returns (engines/kt/families/base.py)
* chat.py     V4's conversation format (encoding_dsv4)
"""
