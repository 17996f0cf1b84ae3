"""Kimi Linear's hybrid decoder: the shared decoder's blocks (DeepSeek MoE after the first dense ones), their mixer
either DeepSeek's MLA without RoPE or Kimi Delta Attention (KDA): q, k and v projections and their short causal
convolutions, the gated delta rule with a decay per key channel (tessera/models/common/deltanet.py's
ChannelGatedRule), whose log decay -exp(A) softplus(f + dt_bias) comes from a low-rank projection f, beta a sigmoid
per head, and the output normed per head (RMSNorm over its values) and gated by the sigmoid of a second low-rank
projection."""

import math

import torch
from torch import nn

from tessera.models.common.attention import KVCache
from tessera.models.common.decoder import Decoder, TransformerBlock
from tessera.models.common.deltanet import ChannelGatedRule, DeltaHeads, DeltaNetCache, LinearMixer, local
from tessera.models.deepseek.mla import MLA


class KimiDeltaAttention(LinearMixer):
    """wq/wk/wv (then, in `rule`, the convolution and the delta rule), wf_a -> wf_b (the decay's input, rank
    head_dim), wb (beta), wg_a -> wg_b (the output gate, rank head_dim), `norm` and wo."""

    label = "Kimi Delta Attention"
    fla_module = ChannelGatedRule.fla[0]

    def __init__(self, dim: int, heads: int, head_dim: int, conv_kernel: int, eps: float):
        super().__init__()
        inner = heads * head_dim
        self.dk = self.dv = head_dim
        self.conv_kernel = conv_kernel
        self.wq = nn.Linear(dim, inner, bias=False)
        self.wk = nn.Linear(dim, inner, bias=False)
        self.wv = nn.Linear(dim, inner, bias=False)
        self.wf_a = nn.Linear(dim, head_dim, bias=False)
        self.wf_b = nn.Linear(head_dim, inner, bias=False)
        self.wb = nn.Linear(dim, heads, bias=False)
        self.wg_a = nn.Linear(dim, head_dim, bias=False)
        self.wg_b = nn.Linear(head_dim, inner, bias=False)
        self.heads = DeltaHeads(inner, inner, heads, conv_kernel, dt_rows=inner)
        self.rule = ChannelGatedRule(head_dim, head_dim)
        self.norm = nn.RMSNorm(head_dim, eps=eps)
        self.wo = nn.Linear(inner, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None, cache: DeltaNetCache | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """As GatedDeltaNet's (`rope` unused)."""
        h = self.heads
        heads = [local(t) for t in (h.conv_q, h.conv_k, h.conv_v, h.A_log, h.dt_bias)]
        inputs = [self.wq(x), self.wk(x), self.wv(x), self.wf_b(self.wf_a(x)), self.wb(x)]
        out = self.rule(inputs, heads, documents, cache, chunk_size=self.chunk_size, fla=self.uses_fla(x.device))
        gate = self.wg_b(self.wg_a(x)).unflatten(-1, (-1, self.dv))
        out = self.norm(out.to(x.dtype)) * torch.sigmoid(gate.float()).to(x.dtype)
        return self.wo(out.flatten(2))


class KimiBlock(TransformerBlock):
    @staticmethod
    def make_attention(args, layer_id: int) -> nn.Module:
        if args.linear(layer_id):
            return KimiDeltaAttention(args.dim, args.linear_heads, args.linear_head_dim, args.conv_kernel,
                                      args.norm_eps)
        return MLA(args, layer_id)


class KimiLinear(Decoder):
    """The shared decoder with Kimi's hybrid blocks. Its decoding cache holds, per block, MLA's keys and values or
    KDA's convolution inputs and recurrent state."""

    block = KimiBlock

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device=None) -> list:
        a = self.args
        return [layer.attention.new_cache(batch, dtype, device) if isinstance(layer.attention, KimiDeltaAttention)
                else KVCache(batch, max_len, a.n_heads, a.head_dim, dtype, device, v_dim=a.v_head_dim)
                for layer in self.layers.values()]

    def param_init(self, name: str, full: torch.Tensor, gen: torch.Generator) -> None:
        """The shared decoder's, but KDA's as fla initializes them: the decay rate exp(A) uniform in [1, 16], dt
        (softplus of dt bias) log-uniform in [1e-3, 0.1], the convolution taps N(0, 1/K) truncated."""
        leaf = name.rpartition(".")[2]
        if leaf == "A_log":
            full.uniform_(1.0, 16.0, generator=gen).log_()
        elif leaf == "dt_bias":
            dt = full.uniform_(math.log(1e-3), math.log(0.1), generator=gen).exp_().clamp_(min=1e-4)
            full.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1
        elif leaf.startswith("conv_"):
            std = full.shape[1] ** -0.5
            nn.init.trunc_normal_(full, 0.0, std, -2 * std, 2 * std, generator=gen)
        else:
            super().param_init(name, full, gen)
