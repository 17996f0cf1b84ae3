"""Building blocks the decoder families share: RoPE, attention, SwiGLU, the decoder stack and its parallelism plan.
Plain PyTorch, no parallelism inside; the plans apply it from outside."""
