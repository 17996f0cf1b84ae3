"""The Qwen 3 group: the dense family (`dense/`, qwen3) and the MoE family (`moe/`, qwen3_moe), and their shared
hyper-parameters (`args.py`)."""
