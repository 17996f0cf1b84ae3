"""Checkpoints: DCP save/resume (manager.py) and Hugging Face safetensors interop (hf.py)."""
