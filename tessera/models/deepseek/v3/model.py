"""DeepSeek V3's decoder: blocks of multi-head latent attention (tessera/models/deepseek/mla.py) and DeepSeek MoE,
and multi-token prediction depths that train beside it."""

import torch
from torch import nn

from tessera.models.common.attention import KVCache
from tessera.models.common.decoder import Decoder, TransformerBlock
from tessera.models.common.side_loss import Lookahead, SideLoss
from tessera.models.deepseek import dsa
from tessera.models.deepseek.mla import MLA
from tessera.models.deepseek.mtp import MTPDecoder


class MLABlock(TransformerBlock):
    @staticmethod
    def make_attention(args, layer_id: int) -> nn.Module:
        return MLA(args, layer_id)


class MTPDepth(nn.Module):
    """One multi-token prediction depth (DeepSeek V3 section 2.2): the previous depth's hidden states and the
    embeddings of the tokens one further on, each normed, concatenated and projected, then one block and a norm
    (the output head is the model's). Its own norm runs in its forward: FSDP gathers a depth's weights there."""

    def __init__(self, args, layer_id: int):
        super().__init__()
        self.enorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.hnorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = MLABlock(args, layer_id)
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, h: torch.Tensor, embeddings: torch.Tensor, rope: torch.Tensor,
                documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(what the next depth takes, what the head reads): its normed output, both."""
        x = self.eh_proj(torch.cat([self.enorm(embeddings), self.hnorm(h)], dim=-1))
        x = self.norm(self.block(x, rope, documents=documents))
        return x, x


class DeepSeekV3(MTPDecoder, Decoder):
    """The shared decoder with MLA blocks (dense SwiGLU for the first `first_k_dense`, DeepSeek MoE after), and
    `n_mtp` multi-token prediction depths that train beside it (their loss is `mtp_loss`, a side loss:
    tessera/models/deepseek/mtp.py)."""

    block = MLABlock

    def __init__(self, args):
        super().__init__(args)
        self.mtp = nn.ModuleDict({str(k): MTPDepth(args, args.n_layers + k) for k in range(args.n_mtp)}) \
            if args.n_mtp else None
        self.mtp_loss = SideLoss("mtp_loss", "deepseek_v3.mtp_loss_weight")
        self.selections = dsa.Selections(bool(args.index_shared))  # DSA: what each indexed block picked, for the
        # blocks that share it, and the dense warm-up's switch
        for attention in (m for m in self.modules() if isinstance(m, MLA) and m.sparse):
            attention.selections = self.selections
        self.lookahead = Lookahead()  # the tokens after each position (across CP ranks' chunks)

    def attend_every_key(self, dense: bool) -> None:
        """DeepSeek V3.2's dense warm-up switch, set by the training step (spec.begin_step): while on, the sparse
        blocks' training forwards attend every key, and the indexers are fitted over all of them."""
        self.selections.dense = dense

    def plain_forward(self, tokens, cache=None, documents=None, positions=None, labels=None) -> torch.Tensor:
        return Decoder.forward(self, tokens, cache, documents, positions, labels)

    def trunk_out(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The normed last hidden states: what the first depth takes and what the head reads."""
        h = self.norm(h)
        return h, h

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device=None) -> list[KVCache]:
        a = self.args  # keys and values expanded per head (the latent itself is not what is cached)
        if a.index_topk:
            return [dsa.IndexedCache(batch, max_len, a.n_heads, a.head_dim, dtype, device, v_dim=a.v_head_dim,
                                     index_dim=a.index_head_dim) for _ in range(a.n_layers)]
        return [KVCache(batch, max_len, a.n_heads, a.head_dim, dtype, device, v_dim=a.v_head_dim)
                for _ in range(a.n_layers)]
