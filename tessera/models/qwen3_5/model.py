"""Qwen 3.5's hybrid decoder (dense and MoE): the shared decoder's stack, its blocks' mixer either Gated DeltaNet
(tessera/models/common/deltanet.py) or full attention with an output gate (sigmoid of a second half of the query
projection, per head), per-head q/k norms and RoPE on the first quarter of each head; norms 1-centred
(weight + 1, stored 0 at init); a MoE block's shared expert scaled by a learned sigmoid gate per token."""

import torch
from torch import nn

from tessera.models.common.attention import CausalSDPA, FeedForward, KVCache
from tessera.models.common.decoder import Decoder
from tessera.models.common.deltanet import GatedDeltaNet
from tessera.models.common.moe import MoE
from tessera.models.common.rope import apply_rope, rope_rows


class CenteredRMSNorm(nn.Module):
    """RMSNorm whose scale is 1 + weight (weight 0 at init), in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GatedAttention(nn.Module):
    """Causal GQA attention; wq yields each head's query and its output gate side by side [2 head_dim]."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, rope_dim: int, eps: float):
        super().__init__()
        self.head_dim, self.rope_dim = head_dim, rope_dim
        self.sdpa = CausalSDPA()
        self.wq = nn.Linear(dim, n_heads * head_dim * 2, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = CenteredRMSNorm(head_dim, eps)
        self.k_norm = CenteredRMSNorm(head_dim, eps)

    def _rope(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        turned, kept = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([apply_rope(turned, rows), kept], dim=-1)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: KVCache | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q, gate = self.wq(x).view(bsz, seq, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.wk(x).view(bsz, seq, -1, self.head_dim))
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        rows = rope_rows(rope, cache.length if cache is not None else 0, seq)
        q, k, v = self._rope(q, rows).transpose(1, 2), self._rope(k, rows).transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v)
        out = self.sdpa(q, k, v) if documents is None else self.sdpa(q, k, v, documents)
        out = out.transpose(1, 2).reshape(bsz, seq, -1) * torch.sigmoid(gate.reshape(bsz, seq, -1))
        return self.wo(out)


class GatedSharedExpert(FeedForward):
    """A SwiGLU for every token, scaled by sigmoid(gate x) (one scalar per token)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__(dim, hidden)
        self.gate = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x)) * super().forward(x)


class SharedGateMoE(MoE):
    """The shared MoE layer with Qwen's gated shared expert in place of plain shared experts."""

    def __init__(self, dim: int, args, shared_hidden: int):
        super().__init__(dim, args)
        self.shared = GatedSharedExpert(dim, shared_hidden)


class HybridBlock(nn.Module):
    def __init__(self, args, layer_id: int):
        super().__init__()
        a = args
        self.attention_norm = CenteredRMSNorm(a.dim, a.norm_eps)
        if a.linear(layer_id):
            self.attention = GatedDeltaNet(a.dim, a.linear_k_heads, a.linear_v_heads, a.linear_k_dim,
                                           a.linear_v_dim, a.conv_kernel, a.norm_eps)
        else:
            self.attention = GatedAttention(a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.rope_dim, a.norm_eps)
        self.ffn_norm = CenteredRMSNorm(a.dim, a.norm_eps)
        sparse = a.moe is not None and a.moe.sparse(layer_id)
        self.feed_forward = SharedGateMoE(a.dim, a.moe, a.shared_hidden) if sparse else FeedForward(a.dim,
                                                                                                   a.ffn_hidden)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache=None, documents: torch.Tensor | None = None):
        x = x + self.attention(self.attention_norm(x), rope, cache=cache, documents=documents)
        return x + self.feed_forward(self.ffn_norm(x))


class Qwen35(Decoder):
    """The shared decoder with hybrid blocks and a 1-centred final norm. Its decoding cache holds, per block, a
    KV cache (full attention) or the DeltaNet's convolution and recurrent state."""

    block = HybridBlock

    def __init__(self, args):
        super().__init__(args)
        self.norm = CenteredRMSNorm(args.dim, args.norm_eps)

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device=None) -> list:
        a = self.args
        return [layer.attention.new_cache(batch, dtype, device) if isinstance(layer.attention, GatedDeltaNet)
                else KVCache(batch, max_len, a.n_kv_heads, a.head_dim, dtype, device) for layer in self.layers.values()]

    def param_init(self, name: str, full: torch.Tensor, gen: torch.Generator) -> None:
        """The shared decoder's, but: 1-centred norms 0; DeltaNet's decay A uniform in [0.01, 16] (log stored), dt
        bias 1 (transformers'), its convolution taps N(0, 1/K) truncated; a gated shared expert's gate 0.02."""
        module, _, leaf = name.rpartition(".")
        owner = self.get_submodule(module) if module else self
        if isinstance(owner, CenteredRMSNorm):
            full.zero_()
        elif leaf == "A_log":
            full.uniform_(0.01, 16.0, generator=gen).log_()
        elif leaf == "dt_bias":
            full.fill_(1.0)
        elif leaf.startswith("conv_"):
            std = full.shape[1] ** -0.5
            nn.init.trunc_normal_(full, 0.0, std, -2 * std, 2 * std, generator=gen)
        else:
            super().param_init(name, full, gen)
