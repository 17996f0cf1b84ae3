"""GPT-OSS: the shared decoder whose attention has biases and a learned sink per head, with a sliding window on
the layers HF's layer_types marks (every other one), and a biased MoE with the clamped SwiGLU in every block."""

from torch import nn

from tessera.models.common.attention import Attention
from tessera.models.common.decoder import Decoder, TransformerBlock


class GptOssBlock(TransformerBlock):
    @staticmethod
    def make_attention(args, layer_id: int) -> nn.Module:
        return Attention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, bias=True,
                         window=args.window if args.sliding(layer_id) else 0, sinks=True)


class GptOss(Decoder):
    block = GptOssBlock
