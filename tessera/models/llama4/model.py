"""Llama 4 (text): the shared decoder whose layers interleave RoPE layers, which attend within chunks and may
L2-normalize q and k after RoPE, with NoPE layers, which attend causally in full and scale their queries up
with the position (temperature tuning); and whose FFNs are a mixture of experts (top-k sigmoid router weighting
the expert's input, one shared expert) in HF's moe_layers and a dense SwiGLU between.

RoPE rotates interleaved pairs (x0, x1), (x2, x3)... as HF's complex multiplication does, so HF's q/k weights
load as they are. The model's position table holds, beside cos and sin, each position's temperature, so the
rows picked by the tokens' positions (global under context parallelism, in-document with documents) carry both.
With documents, chunks count from each document's start."""

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.common.attention import Attention, KVCache
from tessera.models.common.decoder import Decoder, TransformerBlock
from tessera.models.common.rope import rope_rows

COS, SIN, TEMPERATURE = 0, 1, 2  # the rows of the position table


def rotate_pairs(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [batch, seq, heads, head_dim] rotated by the table's cos and sin ([seq, ...] or per token [batch, seq,
    ...]): pair i of each head (its dims 2i, 2i + 1, a complex number) by frequency i, in fp32."""
    half = x.shape[-1] // 2
    cos, sin = table[..., COS, None, :half], table[..., SIN, None, :half]  # the first half holds each frequency once
    real, imag = x.float().unflatten(-1, (half, 2)).unbind(-1)
    return torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1).flatten(-2).type_as(x)


class Llama4Attention(Attention):
    """GQA without biases or learned q/k norms. RoPE layers: chunked, RoPE on pairs, then q and k RMS-normalized
    without a weight (`qk_norm_l2`); NoPE layers: full causal, queries times the position's temperature."""

    def __init__(self, args, layer_id: int):
        use_rope = args.uses_rope(layer_id)
        super().__init__(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, chunk=args.chunk if use_rope else 0)
        self.use_rope, self.tuned = use_rope, not use_rope and args.temperature_tuning
        self.l2_eps = args.norm_eps if use_rope and args.qk_norm_l2 else None

    def _positions(self, q: torch.Tensor, k: torch.Tensor, table: torch.Tensor):
        if self.use_rope:
            q, k = rotate_pairs(q, table), rotate_pairs(k, table)
            if self.l2_eps is not None:
                q, k = (F.rms_norm(t.float(), (t.shape[-1],), eps=self.l2_eps).type_as(t) for t in (q, k))
        elif self.tuned:
            q = (q * table[..., TEMPERATURE, None, :1]).to(q.dtype)
        return q, k

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: KVCache | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """rope: the model's position table [max_seq_len, 3, head_dim] (cos, sin, temperature), or its rows per
        token (see rope_rows)."""
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q, k, v = (w(x).view(bsz, seq, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        start = 0 if cache is None else cache.length
        q, k = self._positions(q, k, rope_rows(rope, start, seq))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k, v = cache.update(k, v)
        out = self.sdpa(q, k, v, documents) if documents is not None else self.sdpa(q, k, v)
        return self.wo(out.transpose(1, 2).flatten(2))


class Llama4Block(TransformerBlock):
    """A MoE FFN in the layers HF's moe_layers names (args.moe.layers), a dense SwiGLU (of ffn_hidden) in the
    others: the shared block's, with Llama 4's attention."""

    @staticmethod
    def make_attention(args, layer_id: int) -> nn.Module:
        return Llama4Attention(args, layer_id)


class Llama4(Decoder):
    block = Llama4Block

    def __init__(self, args):
        super().__init__(args)
        self.register_buffer("rope", torch.empty(args.max_seq_len, 3, args.head_dim, device="meta"), persistent=False)

    def init_buffers(self, device: torch.device, positions: torch.Tensor | None = None) -> None:
        """The position table: RoPE's cos and sin, and the NoPE layers' query temperature, at `positions`
        (default 0 ... max_seq_len - 1). The temperature is computed in fp32 as HF does, so its floor steps fall
        on the same positions."""
        super().init_buffers(device, positions)
        a = self.args
        positions = torch.arange(a.max_seq_len, device=device) if positions is None else positions.to(device)
        temperature = torch.log1p(torch.floor((positions.float() + 1.0) / a.floor_scale)) * a.attn_scale + 1.0
        self.rope = torch.cat([self.rope, temperature[:, None, None].expand(-1, 1, self.rope.shape[-1])], dim=1)
