"""The materialized reference paths that the blockwise ones replaced (scores over every key, masks [queries x keys]):
attention under a boolean mask with sinks, DSA's main attention and indexer loss, DeepSeek V4's window and entries.
Tests hold the new paths to them (tests/test_model.py, test_deepseek_v32.py, test_deepseek_v4.py)."""

import torch
import torch.nn.functional as F

from tessera.models.common.attention import allowed, document_chunks


def masked_attention(q, k, v, window=0, chunk=0, scale=None, sinks=None, documents=None):
    """Queries at the last n_q of the n_k positions, scores materialized under the mask, sinks in the softmax."""
    n_q, n_k = q.shape[2], k.shape[2]
    if documents is not None and chunk:
        documents, chunk = document_chunks(documents, chunk), 0
    mask = allowed(n_q, n_k, window, chunk, q.device)
    if documents is not None:
        mask = (mask & (documents[:, -n_q:, None] == documents[:, None, :])).unsqueeze(1)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1] @ v
    return scores.softmax(dim=-1) @ v


def _selected(logits, mask, topk, stable=False):
    masked = logits.masked_fill(~mask, float("-inf"))
    k = min(topk, masked.shape[-1])
    picks = masked.sort(dim=-1, descending=True, stable=True).indices[..., :k] if stable else \
        masked.topk(k, dim=-1).indices
    return torch.zeros_like(mask).scatter(-1, picks, True) & mask


def _kl(summed, logits, mask):
    p = summed.detach().masked_fill(~mask, 0.0)
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-20)
    log_q = logits.masked_fill(~mask, float("-inf")).log_softmax(dim=-1).masked_fill(~mask, 0.0)
    return (torch.xlogy(p, p) - p * log_q).sum(-1).mean()


def _index_logits(q, k, w, scale):
    """q [b, s, heads, d], k [b, n, d], w [b, s, heads] (1/sqrt(heads) in it) -> [b, s, n]."""
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * scale)
    return torch.matmul(w.float().unsqueeze(-2), scores).squeeze(-2)


def dsa_reference(mla, x, q_latent, rope, q, k, v, documents=None, dense=False, picked=None):
    """MLA's sparse attention as it was: (output [b, heads, s, dv], the indexer's KL or None, the picks [b, s, n])."""
    scoring = None
    mask = allowed(q.shape[2], k.shape[2]).expand(q.shape[0], -1, -1)
    if documents is not None:
        mask = mask & (documents[:, :, None] == documents[:, None, :])
    if mla.indexer is not None:
        scoring, _ = mla.indexer(x.detach(), q_latent.detach(), rope)
        logits = _index_logits(scoring.q, scoring.k, scoring.w, scoring.scale)
        picked = _selected(logits, mask, mla.args.index_topk)
    use = mask if dense else picked
    scores = (q @ k.transpose(-1, -2)) * mla.sdpa.scale
    probs = scores.masked_fill(~use.unsqueeze(1), float("-inf")).softmax(dim=-1, dtype=torch.float32)
    kl = None if scoring is None else _kl(probs.detach().sum(1), logits, use)
    return probs.to(v.dtype) @ v, kl, picked


def v4_reference(attn, q, kv, documents, entries, scoring, window, sinks, scale):
    """V4's attention as it was, all scores materialized: q [b, s, heads, d], kv [b, s, d], entries [b, n, d] or
    None, the CSA indexer's `scoring` or None -> (output [b, s, heads, d], the indexer's KL or None)."""
    seq, n = q.shape[1], 0 if entries is None else entries.shape[1]
    t, s = torch.arange(seq)[:, None], torch.arange(seq)[None]
    near = ((s <= t) & (s > t - window)).unsqueeze(0)
    if documents is not None:
        near = near & (documents[:, :, None] == documents[:, None, :])
    logits = [torch.einsum("bshd,btd->bhst", q, kv).float() * scale]
    masks = [near.unsqueeze(1)]
    kl = None
    if entries is not None:
        w = torch.arange(n)
        ok = ((w + 1) * attn.rate <= t + 1).unsqueeze(0)
        if documents is not None:
            ok = ok & (documents[:, w * attn.rate].unsqueeze(1) == documents.unsqueeze(-1))
        ok = ok.expand(q.shape[0], -1, -1)
        if scoring is not None:
            index = _index_logits(scoring.q, scoring.k, scoring.w, scoring.scale)
            ok = _selected(index, ok, attn.topk, stable=True)
        logits.append(torch.einsum("bshd,btd->bhst", q, entries).float() * scale)
        masks.append(ok.unsqueeze(1))
    logits = [x.masked_fill(~m, float("-inf")) for x, m in zip(logits, masks, strict=True)]
    sink = sinks.float().view(1, -1, 1, 1).expand(*logits[0].shape[:-1], 1)
    probs = torch.cat([*logits, sink], dim=-1).softmax(dim=-1).to(q.dtype)
    out = torch.einsum("bhst,btd->bshd", probs[..., :seq], kv)
    if entries is not None:
        out = out + torch.einsum("bhst,btd->bshd", probs[..., seq:seq + n], entries)
        if scoring is not None:
            kl = _kl(probs[..., seq:seq + n].detach().sum(1), index, ok)
    return out, kl


def v4_layer_reference(attn, x, rope, documents=None):
    """DeepSeek V4's attention layer as it was (tessera/models/deepseek/v4/attention.py before the blockwise
    kernel), on `attn`'s own weights: (its output [b, s, dim], the CSA indexer's KL or None)."""
    from tessera.models.deepseek.v4.attention import rope_tail, unweighted_rms

    rope = rope[..., int(attn.compressed), :, :][:x.shape[1]]
    q_latent = attn.q_norm(attn.wq_a(x))
    q = rope_tail(unweighted_rms(attn.wq_b(q_latent).unflatten(-1, (-1, attn.head_dim)), attn.eps), rope)
    kv = rope_tail(attn.kv(x).unsqueeze(2), rope).squeeze(2)
    entries = attn.compressor(x, rope, documents) if attn.compressor is not None else None
    scoring = attn.indexer(x.detach(), q_latent.detach(), rope, documents) if attn.indexer is not None else None
    out, kl = v4_reference(attn, q, kv, documents, entries, scoring, attn.sdpa.window, attn.sdpa.sinks,
                           attn.sdpa.scale)
    return attn.wo_b(attn.wo_a(rope_tail(out, rope, inverse=True).flatten(2))), kl
