"""DeepSeek Sparse Attention (DSA, DeepSeek V3.2): a lightning indexer scores every earlier key for each query
cheaply, and the main attention attends only the `index_topk` keys it ranks highest.

The indexer (`Indexer`): queries from the main query's bottleneck (`wq_b` of the normed latent, `index_n_heads`
heads of `index_head_dim`), one key per token (`wk` of the hidden state, LayerNorm'd), RoPE (halves, not
interleaved) on the first `qk_rope_head_dim` dims of each, and a weight per head and token (`weights_proj`):
I[t, s] = sum_h w[t, h] / sqrt(H) * relu(q[t, h] . k[s] / sqrt(d)). The top-k of each causal row pick the keys.

Training it (the V3.2 report): its logits I are fitted to the main attention's distribution p (the heads' probabilities
summed, L1-normalized; no gradient into p) by KL(p || softmax(I)), over all causal keys during a dense warm-up (the
main attention dense), over the selected keys after (the main attention sparse). The indexer's inputs are detached:
its only signal is that loss, and the language-model loss reaches the main model only. The loss is a side loss
(`indexer_loss`, each layer's mean over its queries, weighted by `deepseek_v3.indexer_loss_weight`).

GLM-5 (glm_moe_dsa) is the same mechanism, its indexer's RoPE dims in pairs, and some blocks without an indexer:
they attend the keys the previous indexed block picked (`Selections`). The scoring, the top-k and the loss are shared
with DeepSeek V4's CSA indexer (tessera/models/common/sparse.py); the main attention reads the selected keys through
the attention kernel (CausalSDPA's `selected`). No [queries x keys] tensor is kept."""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from tessera.models.common.attention import KVCache
from tessera.models.common.rope import apply_rope
from tessera.models.common.side_loss import SideLoss
from tessera.models.common.sparse import LightningIndexer, Scoring


def dense_probs(q: torch.Tensor, k: torch.Tensor, scale: float, scoring: Scoring, head_sum: nn.Module) -> Callable:
    """`indexer_kl`'s target over every key a query may pick: the main attention's probabilities (q [batch, heads,
    n_q, dim], k [batch, heads, n_k, dim], one softmax per head over the keys it sees, the same keys the indexer may
    pick) summed over heads by `head_sum` (over TP's ranks too)."""
    def target(i0: int, i1: int, end: int) -> torch.Tensor:
        scores = torch.einsum("bhqd,bhkd->bhqk", q[:, :, i0:i1], k[:, :, :end]).float() * scale
        mask = scoring.mask(i0, i1, end).unsqueeze(1)
        return head_sum(scores.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0))
    return target


class Parts(NamedTuple):
    """What a DSA block attends with (MLA's own modules and settings), handed to its sparse core."""
    indexer: LightningIndexer | None  # None: GLM-5's shared block, which attends an earlier block's picks
    sdpa: nn.Module  # the attention kernel
    head_sum: nn.Module
    loss: SideLoss | None  # the indexer's (with an indexer)
    selections: "Selections"
    layer_id: int
    topk: int
    scale: float  # the attention's


def attend(parts: Parts, scoring: Scoring | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           documents: torch.Tensor | None, spans: tuple[tuple[int, int, int], ...], training: bool) -> torch.Tensor:
    """The queries (runs of positions: `spans` of (first query, end, position of the first)) attend the indexer's
    top-k of the keys [0, n_k) (a shared block: the picks of the indexed block before it; during the dense warm-up,
    every key they see, each run against the keys up to its end); while training, the indexer's KL loss to the
    attention's distribution is attached (see the module's docstring). `documents` [b, n_k]: the keys'."""
    if parts.indexer is not None:
        picked = parts.indexer.top_k(scoring, parts.topk)
        if parts.selections.shared:  # GLM-5: blocks after this one attend what it picked
            parts.selections.picks[parts.layer_id] = picked
    else:
        picked = parts.selections.before(parts.layer_id)
    dense = training and parts.selections.dense
    if dense:
        out = torch.cat([parts.sdpa(q[:, :, a:b], k[:, :, :p + b - a], v[:, :, :p + b - a],
                                    *(() if documents is None else (documents[:, :p + b - a],)))
                         for a, b, p in spans], dim=2)
    else:
        out, probs = parts.sdpa(q, k, v, documents, selected=picked)
    if training and scoring is not None and parts.loss.weight:
        if dense:  # over every key the queries see
            loss = parts.indexer.kl(scoring, dense_probs(q, k, parts.scale, scoring, parts.head_sum))
        else:
            loss = parts.indexer.kl(scoring, parts.head_sum(probs, summed=True), picked)
        out = parts.loss.attach(out, loss)
    return out


class SparseCore(nn.Module):
    """DSA on this rank's whole sequence: the indexer's scoring of the queries over the keys, the top-k, the
    attention over them (every key during the dense warm-up) and the indexer's loss (`attend`). Parameterless (its
    block's modules come in `parts`), so context parallelism swaps it for one whose keys span the ranks
    (tessera.parallel.cp.ContextParallelSparse), which takes its `attend`."""

    def forward(self, parts: Parts, x: torch.Tensor, q_latent: torch.Tensor, rope: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, cache: "IndexedCache | None",
                documents: torch.Tensor | None) -> torch.Tensor:
        """The block's inputs `x` and query bottleneck `q_latent` (the indexer's, detached while training), its
        attention's q [b, heads, s, d], k, v (of the new positions: `cache` holds the earlier ones), `documents`
        [b, s] -> the attention's output [b, heads, s, dv]."""
        if self.training:
            x, q_latent = x.detach(), q_latent.detach()
        scoring = None
        if parts.indexer is not None:
            scoring, keys = parts.indexer(x, q_latent, rope, cache.past_index() if cache is not None else None)
            if cache is not None:
                cache.update_index(keys)
            if documents is not None:
                scoring = dataclasses.replace(scoring, q_documents=documents[:, -q.shape[2]:], k_documents=documents)
        if cache is not None:
            k, v = cache.update(k, v)
        return self.attend(parts, scoring, q, k, v, documents, ((0, q.shape[2], k.shape[2] - q.shape[2]),),
                           self.training)

    attend = staticmethod(attend)  # the steps after the keys are in hand (its CP swap runs them too)


class Indexer(LightningIndexer):
    def __init__(self, args):
        super().__init__()
        a, self.args = args, args
        self.wq_b = nn.Linear(a.q_lora_rank, a.index_n_heads * a.index_head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(a.index_head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(a.dim, a.index_n_heads, bias=False)

    def _rope(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        turned, kept = x.split([self.args.qk_rope_head_dim, x.shape[-1] - self.args.qk_rope_head_dim], dim=-1)
        if self.args.index_rope_interleave:  # pairs -> halves (GLM-5): the dot products are the same
            turned = torch.cat([turned[..., 0::2], turned[..., 1::2]], dim=-1)
        return torch.cat([apply_rope(turned, rope), kept], dim=-1)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, rope: torch.Tensor,
                past: torch.Tensor | None = None) -> tuple[Scoring, torch.Tensor]:
        """(the scoring of the queries of `x` / `q_latent` (the main query's normed bottleneck) over the keys of
        `past` positions (cached, when decoding) and of x's own, queries at the last positions; the new positions'
        keys [batch, seq, head dim])."""
        a = self.args
        bsz, seq, _ = x.shape
        new = self._rope(self.k_norm(self.wk(x)).unsqueeze(2), rope).squeeze(2)
        keys = new if past is None else torch.cat([past, new], dim=1)
        q = self._rope(self.wq_b(q_latent).view(bsz, seq, a.index_n_heads, a.index_head_dim), rope)
        weights = self.weights_proj(x) * a.index_n_heads ** -0.5
        return Scoring(q, weights, keys, a.index_head_dim ** -0.5, q_first=keys.shape[1] - seq), new


class Selections:
    """What a model's sparse blocks share, one per model, its blocks' attention all holding it: the keys each indexed
    block picked in the current forward ([batch, queries, top-k] indices), by block, for the blocks after it that
    share them (GLM-5's "shared" blocks), kept until the next forward replaces them, so a block recomputed in
    backward (activation checkpointing) reads what its forward read; and the dense warm-up's switch, which the
    training step sets (DeepSeekV3.attend_every_key): while on, training forwards attend every key."""

    def __init__(self, shared: bool):
        self.shared = shared  # some blocks share an earlier one's selection: the indexed blocks keep theirs here
        self.picks: dict[int, torch.Tensor] = {}
        self.dense = False

    def before(self, layer_id: int) -> torch.Tensor:
        earlier = [i for i in self.picks if i < layer_id]
        if not earlier:
            raise RuntimeError(f"block {layer_id} shares the keys of an earlier indexed block, and none ran before it "
                               f"in this forward")
        return self.picks[max(earlier)]


class IndexedCache(KVCache):
    """A DSA layer's decoding cache: the main attention's keys and values and the indexer's keys."""

    def __init__(self, batch: int, max_len: int, n_heads: int, head_dim: int, dtype: torch.dtype, device=None,
                 v_dim: int = 0, index_dim: int = 0):
        super().__init__(batch, max_len, n_heads, head_dim, dtype, device, v_dim)
        self.register_buffer("index_k", torch.zeros(batch, max_len, index_dim, dtype=dtype, device=device))

    def past_index(self) -> torch.Tensor:
        """The indexer's keys of the positions so far (before update() adds the new ones)."""
        return self.index_k[:, :self.length]

    def update_index(self, k: torch.Tensor) -> None:
        """Write the indexer's keys [batch, new, dim] at the positions update() will fill next."""
        self.index_k[:, self.length:self.length + k.shape[1]] = k
