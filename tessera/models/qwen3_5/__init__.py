"""The Qwen 3.5 group: the hybrid decoder of Gated DeltaNet and gated full-attention blocks (`model.py`), its
hyper-parameters, counts, options, plan and Hugging Face names, shared by the dense family (`dense/`, qwen3_5) and
the MoE family (`moe/`, qwen3_5_moe)."""
