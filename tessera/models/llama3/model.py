"""Llama 3 decoder: the shared decoder of tessera.models.common. Weights follow the Hugging Face layout (RoPE
rotates halves, not interleaved pairs), so HF checkpoints load without permuting q/k."""

from tessera.models.common.decoder import Decoder as Transformer

__all__ = ["Transformer"]
