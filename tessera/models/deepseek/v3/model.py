"""Multi-head latent attention (DeepSeek V2/V3) and the decoder built with it: queries from an optional low-rank
bottleneck, keys and values expanded per head from one normed latent, and RoPE on a slice of each head whose key
is shared by all heads. Values have a head size of their own."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.common.attention import CausalSDPA, KVCache, allowed
from tessera.models.common.decoder import Decoder, TransformerBlock
from tessera.models.common.rope import apply_rope, rope_rows
from tessera.models.common.side_loss import Lookahead, SideLoss
from tessera.models.deepseek import dsa

IGNORE = -100  # the label of a position that is not trained (tessera.data.masks's)


def _softmax_scale(args) -> float:
    """head_dim^-1/2, times YaRN's mscale(factor, mscale_all_dim)^2 for a long-context (scaled) RoPE."""
    scale, yarn = args.head_dim ** -0.5, args.rope_scaling or {}
    if yarn.get("mscale_all_dim") and yarn.get("factor", 1) > 1:
        scale *= (0.1 * yarn["mscale_all_dim"] * math.log(yarn["factor"]) + 1.0) ** 2
    return scale


class MLA(nn.Module):
    def __init__(self, args, layer_id: int = 0):
        super().__init__()
        # _layer_id: which block this is (DSA's shared selections), no setting of its own (tessera.estimate traces
        # blocks alike in all else as one kind)
        a, self.args, self._layer_id = args, args, layer_id
        q_out = a.n_heads * a.head_dim
        if a.q_lora_rank:
            self.wq_a = nn.Linear(a.dim, a.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(a.q_lora_rank, eps=1e-6)
            self.wq_b = nn.Linear(a.q_lora_rank, q_out, bias=False)
        else:
            self.wq = nn.Linear(a.dim, q_out, bias=False)
        self.wkv_a = nn.Linear(a.dim, a.kv_lora_rank + a.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(a.kv_lora_rank, eps=1e-6)
        self.wkv_b = nn.Linear(a.kv_lora_rank, a.n_heads * (a.qk_nope_head_dim + a.v_head_dim), bias=False)
        self.wo = nn.Linear(a.n_heads * a.v_head_dim, a.dim, bias=False)
        self.sdpa = CausalSDPA(scale=_softmax_scale(a))
        self.sparse, self.indexer = bool(a.index_topk), None
        if self.sparse:  # V3.2: sparse attention over the keys its indexer picks, the indexer's loss beside it
            if layer_id not in a.index_shared:  # else (GLM-5) those of the indexed block before it
                self.indexer = dsa.Indexer(a)
                self.indexer_loss = SideLoss("indexer_loss", "deepseek_v3.indexer_loss_weight")
            self.selections = dsa.Selections()  # the model shares one among its blocks
            self.head_sum = dsa.HeadSum()
            self.dense_warmup_steps = 0  # the options set it: steps attending every key, the indexer fitted to them

    def _rope(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        if self.args.rope_interleave:  # pairs (x0, x1), (x2, x3)... -> halves: the dot products are the same
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return apply_rope(x, rope)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: KVCache | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        a = self.args
        bsz, seq, _ = x.shape
        q_latent = self.q_norm(self.wq_a(x)) if a.q_lora_rank else None
        q = self.wq_b(q_latent) if a.q_lora_rank else self.wq(x)
        q = q.view(bsz, seq, -1, a.head_dim)  # -1 heads: under tensor parallelism a rank's share
        q_nope, q_rot = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.wkv_a(x).split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seq, -1, a.qk_nope_head_dim + a.v_head_dim)
        k_nope, v = kv.split([a.qk_nope_head_dim, a.v_head_dim], dim=-1)
        start = cache.length if cache is not None else 0
        positions = rope_rows(rope, start, seq)
        q = torch.cat([q_nope, self._rope(q_rot, positions)], dim=-1)
        k_rot = self._rope(k_rot.unsqueeze(2), positions).expand(-1, -1, k_nope.shape[2], -1)
        k = torch.cat([k_nope, k_rot], dim=-1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.sparse:
            out = self._sparse(x, q_latent, positions, q, k, v, cache, documents)
        else:
            if cache is not None:
                k, v = cache.update(k, v)
            out = self.sdpa(q, k, v) if documents is None else self.sdpa(q, k, v, documents)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))

    def _sparse(self, x: torch.Tensor, q_latent: torch.Tensor, rope: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, cache: "dsa.IndexedCache | None", documents: torch.Tensor | None) -> torch.Tensor:
        """DSA: the queries attend the indexer's top-k keys (every key during the dense warm-up); while training, the
        indexer's KL loss to the attention's distribution is attached (its inputs detached: see dsa.py)."""
        if self.training:
            x, q_latent = x.detach(), q_latent.detach()
        indexed = self.indexer is not None
        if indexed:
            self.selections.steps = self.indexer_loss.steps
        logits = None
        if indexed:
            logits, keys = self.indexer(x, q_latent, rope, cache.past_index() if cache is not None else None)
            if cache is not None:
                cache.update_index(keys)
        if cache is not None:
            k, v = cache.update(k, v)
        mask = allowed(q.shape[2], k.shape[2], device=q.device).expand(q.shape[0], -1, -1)
        if documents is not None:
            mask = mask & (documents[:, -q.shape[2]:, None] == documents[:, None, :])
        if indexed:
            self.selections.masks[self._layer_id] = dsa.selected(logits, mask, self.args.index_topk)
        if not (self.training and self.selections.steps < self.dense_warmup_steps):
            mask = self.selections.masks[self._layer_id] if indexed else self.selections.before(self._layer_id)
        out, probs = dsa.attention_with_probs(q, k, v, mask, self.sdpa.scale)
        if self.training and indexed and self.indexer_loss.weight:
            out = self.indexer_loss.attach(out, dsa.indexer_kl(self.head_sum(probs.detach()), logits, mask))
        return out


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
        selections = dsa.Selections()  # DSA: what each indexed block picked, for the blocks that share it
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
