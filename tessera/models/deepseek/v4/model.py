"""DeepSeek V4's decoder: `hc_mult` residual streams mixed by manifold-constrained hyper-connections (mHC) around
each block's attention (tessera/models/deepseek/v4/attention.py) and DeepSeek MoE (hash-routed in the first
blocks), collapsed into one before the final norm.

Between blocks the streams travel as one tensor [batch, seq, hc_mult x dim] (so pipeline stages and sequence
parallelism see an ordinary stream). Around a sublayer, weights computed from the normed streams collapse them
into its input (`pre`, a sigmoid per stream), spread its output over them (`post`) and mix the streams themselves
(`comb`, made doubly stochastic by Sinkhorn-Knopp iterations); in fp32."""

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.common.decoder import Decoder
from tessera.models.common.moe import MoE
from tessera.models.common.rope import attention_factor, inv_freq, rope_table
from tessera.models.common.side_loss import Lookahead, SideLoss
from tessera.models.deepseek.mtp import MTPDecoder
from tessera.models.deepseek.v4.attention import V4Attention, unweighted_rms


class HyperMix(nn.Module):
    """The weights' logits from the normed streams [batch, seq, hc x dim] (fp32): `fn` [sum(parts), hc x dim],
    each part times its own `scale`, plus `base`."""

    def __init__(self, width: int, parts: tuple[int, ...]):
        super().__init__()
        self.parts = parts
        self.fn = nn.Parameter(torch.empty(sum(parts), width))
        self.base = nn.Parameter(torch.empty(sum(parts)))
        self.scale = nn.Parameter(torch.empty(len(parts)))

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        mixed = F.linear(normed, self.fn.float()).split(self.parts, dim=-1)
        return torch.cat([m * self.scale[i].float() for i, m in enumerate(mixed)], dim=-1) + self.base.float()


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., n, n] -> columns, then rows and columns `iters` - 1 times more, normalized to sum to 1."""
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


class V4Block(nn.Module):
    def __init__(self, args, layer_id: int):
        super().__init__()
        hc = self.hc = args.hc_mult
        self.iters, self.hc_eps, self.eps = args.hc_sinkhorn_iters, args.hc_eps, args.norm_eps
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = V4Attention(args, layer_id)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = MoE(args.dim, args.block_moe(layer_id))
        self.attention_hc = HyperMix(hc * args.dim, (hc, hc, hc * hc))
        self.ffn_hc = HyperMix(hc * args.dim, (hc, hc, hc * hc))

    def forward(self, h: torch.Tensor, rope: torch.Tensor, cache=None, documents: torch.Tensor | None = None,
                tokens: torch.Tensor | None = None) -> torch.Tensor:
        """h [batch, seq, hc x dim]; `tokens` the input ids (hash routing reads them)."""
        h = self._around(h, self.attention_hc,
                         lambda x: self.attention(self.attention_norm(x), rope, cache=cache, documents=documents))
        return self._around(h, self.ffn_hc, lambda x: self.feed_forward(self.ffn_norm(x), ids=tokens))

    def _around(self, h: torch.Tensor, mix: HyperMix, sublayer) -> torch.Tensor:
        hc = self.hc
        streams = h.unflatten(-1, (hc, -1))
        pre, post, comb = mix(unweighted_rms(h.float(), self.eps)).split([hc, hc, hc * hc], dim=-1)
        pre = torch.sigmoid(pre) + self.hc_eps
        comb = sinkhorn(comb.unflatten(-1, (hc, hc)).softmax(-1) + self.hc_eps, self.iters, self.hc_eps)
        out = sublayer((pre.unsqueeze(-1) * streams).sum(2).to(h.dtype))
        spread = (2 * torch.sigmoid(post)).to(h.dtype).unsqueeze(-1) * out.unsqueeze(-2)
        return spread.flatten(2) + (comb.to(h.dtype).transpose(-1, -2) @ streams).flatten(2)  # a fresh tensor


def collapse(h: torch.Tensor, mix: HyperMix, hc: int, eps: float, hc_eps: float) -> torch.Tensor:
    """Streams [batch, seq, hc x dim] -> one [batch, seq, dim], weighted by a sigmoid each (a `hc_head`)."""
    pre = torch.sigmoid(mix(unweighted_rms(h.float(), eps))) + hc_eps
    return (pre.unsqueeze(-1) * h.unflatten(-1, (hc, -1))).sum(2).to(h.dtype)


class MTPDepth(nn.Module):
    """One multi-token prediction depth (the release's MTPBlock): the embeddings of the tokens k further on, normed
    and projected (e_proj), added to each of the previous depth's streams (the trunk's before their collapse, for
    k = 1), each normed and projected (h_proj); then a whole block (block n_layers + k, routed by score) over the
    streams, which the next depth takes; the head reads them collapsed by its own hc_head and normed by its own
    norm (the output head is the model's)."""

    def __init__(self, args, layer_id: int):
        super().__init__()
        d, self.hc, self.eps, self.hc_eps = args.dim, args.hc_mult, args.norm_eps, args.hc_eps
        self.enorm, self.hnorm, self.norm = (nn.RMSNorm(d, eps=args.norm_eps) for _ in range(3))
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.block = V4Block(args.with_depths(), layer_id)
        self.hc_head = HyperMix(self.hc * d, (self.hc,))

    def forward(self, h: torch.Tensor, embeddings: torch.Tensor, rope: torch.Tensor,
                documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(its streams, which the next depth takes; what the head reads)."""
        streams = self.h_proj(self.hnorm(h.unflatten(-1, (self.hc, -1))))
        x = (streams + self.e_proj(self.enorm(embeddings)).unsqueeze(-2)).flatten(2)
        x = self.block(x, rope, documents=documents)
        return x, self.norm(collapse(x, self.hc_head, self.hc, self.eps, self.hc_eps))


class InputCache(nn.Module):
    """A block's decoding cache: its attention's inputs so far (decoding recomputes keys, compressed entries and
    the indexer's from them: a reference path)."""

    def __init__(self, batch: int, max_len: int, dim: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.register_buffer("x", torch.zeros(batch, max_len, dim, dtype=dtype, device=device))
        self.length = 0

    def extend(self, x: torch.Tensor) -> torch.Tensor:
        self.x[:, self.length:self.length + x.shape[1]] = x
        self.length += x.shape[1]
        return self.x[:, :self.length]


class DeepSeekV4(MTPDecoder, Decoder):
    """The shared decoder's embedding, head and plumbing with V4's blocks; the streams collapsed (`hc_head`) before
    the final norm; `n_mtp` multi-token prediction depths that train beside it (their loss is `mtp_loss`, a side
    loss: tessera/models/deepseek/mtp.py). The RoPE buffer holds two tables: sliding blocks', compressed blocks'
    [positions, 2, 2, dim]."""

    block = V4Block

    def __init__(self, args):
        super().__init__(args)
        self.hc_head = HyperMix(args.hc_mult * args.dim, (args.hc_mult,))
        self.register_buffer("rope", torch.empty(args.max_seq_len, 2, 2, args.rope_head_dim, device="meta"),
                             persistent=False)
        self.mtp = nn.ModuleDict({str(k): MTPDepth(args, args.n_layers + k) for k in range(args.n_mtp)}) \
            if args.n_mtp else None
        self.mtp_loss = SideLoss("mtp_loss", "deepseek_v4.mtp_loss_weight")
        self.lookahead = Lookahead()

    def init_buffers(self, device: torch.device, positions: torch.Tensor | None = None) -> None:
        a = self.args
        if positions is None:
            positions = torch.arange(a.max_seq_len, device=device)
            for module in self.modules():
                if isinstance(module, MoE):
                    module.reset_buffers()
        positions = positions.to(device)
        compressed = inv_freq(a.rope_head_dim, a.compress_rope_theta, a.rope_scaling, a.max_seq_len)
        self.rope = torch.stack([rope_table(positions, inv_freq(a.rope_head_dim, a.rope_theta)),
                                 rope_table(positions, compressed, attention_factor(a.rope_scaling))], dim=1)

    def plain_forward(self, tokens: torch.Tensor, cache: list | None = None, documents: torch.Tensor | None = None,
                      positions: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.hidden(tokens, cache, documents, positions)
        if self.norm is None:
            return h
        h = self.norm(self.collapse(h))
        return self.head(h) if labels is None else self.token_loss(h, labels)

    def trunk_out(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last block's streams, which the first depth takes; them collapsed and normed, which the head reads)."""
        return h, self.norm(self.collapse(h))

    def trunk_width(self) -> int:
        return self.args.hc_mult * self.args.dim

    def hidden(self, tokens: torch.Tensor, cache: list | None = None, documents: torch.Tensor | None = None,
               positions: torch.Tensor | None = None) -> torch.Tensor:
        """The last block's streams [batch, seq, hc x dim]. A stage after the first takes the streams, and has no
        token ids: a hash-routed block there is refused (parallelize)."""
        first = self.tok_embeddings is not None
        h = self.tok_embeddings(tokens).repeat(1, 1, self.args.hc_mult) if first else tokens
        rope = self.rope if positions is None else self.rope[positions]
        for i, layer in enumerate(self.layers.values()):
            h = layer(h, rope, cache=cache[i] if cache is not None else None, documents=documents,
                      tokens=tokens if first else None)
        return h

    def collapse(self, h: torch.Tensor) -> torch.Tensor:
        """The streams -> one [batch, seq, dim], weighted by a sigmoid each (hc_head)."""
        return collapse(h, self.hc_head, self.args.hc_mult, self.args.norm_eps, self.args.hc_eps)

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device=None) -> list[InputCache]:
        return [InputCache(batch, max_len, self.args.dim, dtype, device) for _ in range(self.args.n_layers)]

    def param_init(self, name: str, full: torch.Tensor, gen: torch.Generator) -> None:
        """The shared decoder's, but as transformers initializes them: sinks, the compressors' slot biases and the
        hyper-connections' biases 0, their scales 1."""
        leaf = name.rpartition(".")[2]
        if leaf in ("sinks", "ape", "base"):
            full.zero_()
        elif leaf == "scale":
            full.fill_(1.0)
        else:
            super().param_init(name, full, gen)
