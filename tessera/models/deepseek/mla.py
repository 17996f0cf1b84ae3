"""Multi-head latent attention (DeepSeek V2/V3), the DeepSeek group's shared attention (DeepSeek V3 / V3.2 /
GLM-5 blocks, Kimi Linear's full-attention blocks): queries from an optional low-rank bottleneck, keys and values
expanded per head from one normed latent, and RoPE on a slice of each head whose key is shared by all heads (not
turned where the args say so: Kimi Linear's NoPE). Values have a head size of their own. With `index_topk`, DeepSeek
V3.2's sparse attention (tessera/models/deepseek/dsa.py)."""

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.models.common import sparse
from tessera.models.common.attention import CausalSDPA, KVCache
from tessera.models.common.rope import apply_rope, rope_rows
from tessera.models.common.side_loss import SideLoss
from tessera.models.deepseek import dsa


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
        # blocks alike in all else as one kind); read only where blocks share selections (GLM-5), since compile
        # specializes a block on it
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
            self.selections = dsa.Selections(bool(a.index_shared))  # the model shares one among its blocks
            self.head_sum = sparse.HeadSum()
            self.sparse_core = dsa.SparseCore()  # its steps, which context parallelism swaps

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
        latent = self.kv_norm(latent)
        positions, k_rot = rope_rows(rope, cache.length if cache is not None else 0, seq), k_rot.unsqueeze(2)
        if a.mla_rope:  # else (Kimi Linear's MLA, NoPE) the "rope" slices stay as they are
            q_rot, k_rot = self._rope(q_rot, positions), self._rope(k_rot, positions)
        if self.sparse and cache is None and self._absorbable():
            q, k, v, expand = self._absorbed(q_nope, q_rot, latent, k_rot)
        else:
            kv = self.wkv_b(latent).view(bsz, seq, -1, a.qk_nope_head_dim + a.v_head_dim)
            k_nope, v = kv.split([a.qk_nope_head_dim, a.v_head_dim], dim=-1)
            q = torch.cat([q_nope, q_rot], dim=-1).transpose(1, 2)
            k = torch.cat([k_nope, k_rot.expand(-1, -1, k_nope.shape[2], -1)], dim=-1).transpose(1, 2)
            v, expand = v.transpose(1, 2), None
        if self.sparse:
            out = self.sparse_core(self.parts(), x, q_latent, positions, q, k, v, cache, documents)
            out = out if expand is None else expand(out)
        else:
            if cache is not None:
                k, v = cache.update(k, v)
            out = self.sdpa(q, k, v) if documents is None else self.sdpa(q, k, v, documents)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))

    def _absorbable(self) -> bool:
        """Whether wkv_b computes with its weight alone (no adapter or converted matmul beside it)."""
        return type(self.wkv_b) is nn.Linear and not self.wkv_b._forward_hooks

    def _absorbed(self, q_nope: torch.Tensor, q_rot: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor):
        """Sparse attention in the latent (DeepSeek's inference form, what sparse kernels take): a head's key part
        W_k c and value W_v c both expand the one latent c, so q . W_k c = (W_k^T q) . c and the output W_v (sum p c):
        every head reads one shared key [latent; rope key] and value [latent] (MQA), gathered once per selected key
        instead of once per head. -> (queries [b, heads, s, latent + rope], keys [b, 1, s, latent + rope], values
        [b, 1, s, latent], the map of outputs [b, heads, s, latent] to the heads' values)."""
        a = self.args
        w = self.wkv_b.weight
        w = (w.to_local() if isinstance(w, DTensor) else w).view(-1, a.qk_nope_head_dim + a.v_head_dim, a.kv_lora_rank)
        w_k, w_v = w.split([a.qk_nope_head_dim, a.v_head_dim], dim=1)  # this rank's heads
        q = torch.cat([torch.einsum("bshn,hnc->bshc", q_nope, w_k), q_rot], dim=-1).transpose(1, 2)
        k = torch.cat([latent.unsqueeze(2), k_rot], dim=-1).transpose(1, 2)
        return q, k, latent.unsqueeze(1), lambda out: torch.einsum("bhsc,hvc->bhsv", out, w_v)

    def parts(self) -> "dsa.Parts":
        return dsa.Parts(self.indexer, self.sdpa, self.head_sum, getattr(self, "indexer_loss", None), self.selections,
                         self._layer_id, self.args.index_topk, self.sdpa.scale)
