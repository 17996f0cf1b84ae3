"""DeepSeek V3's decoder: blocks of multi-head latent attention (tessera/models/deepseek/mla.py) and DeepSeek MoE,
and multi-token prediction depths that train beside it."""

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.common.attention import KVCache
from tessera.models.common.decoder import Decoder, TransformerBlock
from tessera.models.common.side_loss import Lookahead, SideLoss
from tessera.models.deepseek import dsa
from tessera.models.deepseek.mla import MLA

IGNORE = -100  # the label of a position that is not trained (tessera.data.masks's)


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
                documents: torch.Tensor | None = None) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embeddings), self.hnorm(h)], dim=-1))
        return self.norm(self.block(x, rope, documents=documents))


class DeepSeekV3(Decoder):
    """The shared decoder with MLA blocks (dense SwiGLU for the first `first_k_dense`, DeepSeek MoE after), and
    `n_mtp` multi-token prediction depths that train beside it (their loss is `mtp_loss`, a side loss)."""

    block = MLABlock
    side_loss_labels = True  # the MTP loss trains only where the labels do: it needs them also unchunked

    def __init__(self, args):
        super().__init__(args)
        self.mtp = nn.ModuleDict({str(k): MTPDepth(args, args.n_layers + k) for k in range(args.n_mtp)}) \
            if args.n_mtp else None
        self.mtp_loss = SideLoss("mtp_loss", "deepseek_v3.mtp_loss_weight")
        selections = dsa.Selections(bool(args.index_shared))  # DSA: what each indexed block picked, for the blocks
        # that share it
        for attention in (m for m in self.modules() if isinstance(m, MLA) and m.sparse):
            attention.selections = selections
        self.lookahead = Lookahead()  # the tokens after each position (across CP ranks' chunks)

    def forward(self, tokens: torch.Tensor, cache: list[KVCache] | None = None,
                documents: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.carries_embeddings():
            return self.stage_forward(tokens, documents, positions, labels)
        if not (self.training and self.mtp is not None and self.mtp_loss.weight and cache is None):
            return super().forward(tokens, cache, documents, positions, labels)
        h = self.norm(self.hidden(tokens, documents=documents, positions=positions))
        return self.with_mtp(h, None, tokens, documents, positions, labels)

    def carries_embeddings(self) -> bool:
        """Whether this is a pipeline stage (it lacks the embedding or the final norm) of a model that trains its
        MTP depths: then what passes between stages is [hidden states; input embeddings] (2 x dim wide), so that
        the depths, on the last stage, get the embeddings of the whole sequence from the first stage, and their
        gradient goes back to the embedding the way the hidden states' does (no copy of it to keep in step)."""
        return bool(self.args.n_mtp and self.mtp_loss.weight) and (self.tok_embeddings is None or self.norm is None)

    def stream_width(self) -> int:
        return 2 * self.args.dim if self.carries_embeddings() else self.args.dim

    def stage_forward(self, x: torch.Tensor, documents: torch.Tensor | None, positions: torch.Tensor | None,
                      labels: torch.Tensor | None) -> torch.Tensor:
        """One pipeline stage's forward (see carries_embeddings): the first takes the tokens, the others the
        stream; the last returns what forward does, the depths run only while they train (the trainer's view of
        the stages switches them to eval, not the stage itself)."""
        if self.tok_embeddings is not None:
            embeddings = self.tok_embeddings(x)
        else:
            x, embeddings = x.chunk(2, dim=-1)
        h = self.hidden(x, documents=documents, positions=positions)
        if self.norm is None:
            return torch.cat([h, embeddings], dim=-1)
        h = self.norm(h)
        if not self.mtp.training:
            return self.head(h) if labels is None else self.token_loss(h, labels)
        return self.with_mtp(h, embeddings, None, documents, positions, labels)

    def with_mtp(self, h: torch.Tensor, embeddings: torch.Tensor | None, tokens: torch.Tensor | None,
                 documents: torch.Tensor | None, positions: torch.Tensor | None,
                 labels: torch.Tensor | None) -> torch.Tensor:
        """The head's output (or the token loss, given labels) of the normed last hidden states `h`, the depths'
        weighted loss attached to it. `tokens`: the targets without labels (a pipeline passes labels)."""
        # Depth k at slot i predicts token i+k+1, the target of label i+k: its inputs hold the last target but
        # one, so each depth's slots from seq - k - 1 on (whose targets are the window's next token, or past it)
        # are left out of its loss. Given labels, a depth trains where label i+k does (not on prompts, nor where a
        # document starts), its loss the mean over those targets (0 when none); without labels, on the tokens.
        # The targets are read ahead on the whole sequence, so that they cross CP ranks' chunks.
        # Under pipelining `embeddings` are the first stage's, carried to the last (see carries_embeddings).
        depths = enumerate(self.mtp_hidden(h, tokens, documents, positions, embeddings), 1)
        ahead = self.lookahead.ahead
        if labels is None:
            losses = [F.cross_entropy(self.head(out).flatten(0, 1).float(), ahead(tokens, k + 1, IGNORE).flatten(),
                                      ignore_index=IGNORE) for k, out in depths]
        else:
            targets = {k: ahead(labels, k, IGNORE, end=1) for k in range(1, len(self.mtp) + 1)}
            losses = [self.token_loss(out, targets[k]) / self.lookahead.trained(targets[k]) for k, out in depths]
        main = self.head(h) if labels is None else self.token_loss(h, labels)
        return self.mtp_loss.attach(main, torch.stack(losses).mean())

    def mtp_logits(self, h: torch.Tensor, tokens: torch.Tensor, documents: torch.Tensor | None = None,
                   positions: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Each depth's logits [batch, seq - k, vocab] (k = 1, 2...): its slots that hold tokens; see mtp_hidden."""
        out = self.mtp_hidden(h, tokens, documents, positions)
        return [self.head(x[:, :x.shape[1] - k]) for k, x in enumerate(out, 1)]

    def mtp_hidden(self, h: torch.Tensor, tokens: torch.Tensor | None, documents: torch.Tensor | None = None,
                   positions: torch.Tensor | None = None, embeddings: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Each depth's normed output [batch, seq, dim] (k = 1, 2...), from the trunk's normed last hidden states
        and the input tokens; a depth passes on its own normed output (as transformers' MtpModel does). Its slot i
        holds token i + k (its document and position are that token's); its last k slots, past the window, repeat
        the last token and train nothing. Whole-length, a depth's sequence splits over TP and CP like the trunk's.
        On a pipeline's last stage the inputs' `embeddings` (the first stage's, whole sequences: PP with MTP runs
        without TP and CP) are shifted instead of embedding the tokens read ahead."""
        out, ahead = [], self.lookahead.ahead
        for k, depth in enumerate(self.mtp.values(), 1):
            rope = self.rope if positions is None else self.rope[ahead(positions, k)]
            docs = None if documents is None else ahead(documents, k)
            if embeddings is None:
                inputs = self.tok_embeddings(ahead(tokens, k))
            else:  # the tokens' shift, on their embeddings (along the sequence, dim 1)
                inputs = Lookahead.shift(embeddings.transpose(1, 2), k).transpose(1, 2)
            h = depth(h, inputs, rope, docs)
            out.append(h)
        return out

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device=None) -> list[KVCache]:
        a = self.args  # keys and values expanded per head (the latent itself is not what is cached)
        if a.index_topk:
            return [dsa.IndexedCache(batch, max_len, a.n_heads, a.head_dim, dtype, device, v_dim=a.v_head_dim,
                                     index_dim=a.index_head_dim) for _ in range(a.n_layers)]
        return [KVCache(batch, max_len, a.n_heads, a.head_dim, dtype, device, v_dim=a.v_head_dim)
                for _ in range(a.n_layers)]
