"""Gated DeltaNet (Yang et al. 2024), the linear-attention mixer of Qwen 3.5 and Qwen3-Next, and its rule with a
decay per key channel, Kimi Delta Attention's (Kimi Linear): a short causal depthwise convolution over q, k and v,
L2-normed q and k, and a matrix state S [k_dim, v_dim] per value head that each token decays by exp(g) (one g per
head, or per key channel: diag(exp(g)) S) and corrects towards its value by the delta rule,

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T q_t / sqrt(k_dim),

then the mixer's gated RMSNorm and out-projection (Gated DeltaNet's here; KDA's in its family).

Training runs the chunked form (the WY/UT representation): within a chunk of `chunk_size` tokens the updates are
a few matmuls and one triangular solve, across chunks a scan carries S. It is plain torch, differentiable, any
device: the CPU path and the reference. On CUDA the `fla` kernels run instead when `flash-linear-attention` is
installed (the `fla` extra; `kernel = "auto"`). Packed documents reset the state (and the convolution's window) at
each document's first token, as if each ran alone. Decoding keeps the convolution's last inputs and S as its cache.
"""

import importlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """Under TP a rank holds its heads' per-head parameters (Shard(0)); the math runs on them."""
    return t.to_local() if isinstance(t, DTensor) else t


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, documents: torch.Tensor | None = None,
                state: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution then SiLU: x [batch, seq, channels], weight [channels, K]; out[t] =
    silu(sum_j weight[:, j] x[t - K + 1 + j]). `documents` [batch, seq]: inputs of another document count as 0;
    `state` [batch, K - 1, channels]: the inputs before x (decoding), else zeros."""
    k = weight.shape[1]
    past = state if state is not None else x.new_zeros(x.shape[0], k - 1, x.shape[2])
    padded = torch.cat([past.to(x.dtype), x], dim=1)
    seq = x.shape[1]
    out = 0
    for j in range(k):  # tap j reads the input K - 1 - j steps back
        shifted = padded[:, j:j + seq]
        if documents is not None and j < k - 1:
            back = k - 1 - j
            same = torch.zeros_like(documents, dtype=torch.bool)
            same[:, back:] = documents[:, back:] == documents[:, :-back]
            shifted = shifted * same[..., None]
        out = out + shifted * weight[:, j]
    return F.silu(out)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           chunk_size: int = 64, state: torch.Tensor | None = None,
                           documents: torch.Tensor | None = None, scan=None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [batch, seq, heads, dk] (L2-normed; scaled here), v [batch, seq, heads, dv], beta [batch, seq, heads],
    g the log decay (<= 0): [batch, seq, heads] (Gated DeltaNet's, one per head) or [batch, seq, heads, dk] (Kimi
    Delta Attention's, one per key channel: the state's rows decay apart); `state` [batch, heads, dk, dv] (default
    0); `documents` [batch, seq]: the state resets at each document's first token. -> (out [batch, seq, heads, dv],
    final state), computed in fp32. `scan`: the scan across chunks (default `delta_scan`; tessera.estimate traces
    one that allocates its bytes at once)."""
    dtype, (bsz, seq, heads, dk), dv = v.dtype, k.shape, v.shape[-1]
    channels = g.dim() == 4
    pad = (-seq) % chunk_size
    n = (seq + pad) // chunk_size

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [b, s, h, ...] -> [b, h, n, c, ...] in fp32, zero-padded
        x = x.float().transpose(1, 2)
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 4 else F.pad(x, (0, pad))
        return x.reshape(bsz, heads, n, chunk_size, *x.shape[3:])

    q, k, v, beta = chunks(q * dk ** -0.5), chunks(k), chunks(v), chunks(beta)
    cum = chunks(g if channels else g[..., None]).cumsum(-2)  # [b, h, n, c, dk or 1]: log decay from the chunk's
    last = cum[..., -1:, :]  # start to each position, inclusive
    mask = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()  # j <= i
    reads = cum.exp()  # how much of the state before the chunk each position still sees
    writes = (last - cum).exp()  # how much of each position's write survives to the chunk's end
    carry = last.squeeze(-2).exp()  # of the state before the chunk, at its end
    if documents is not None:
        docs = torch.cat([documents[:, :1], documents, documents[:, -1:].expand(-1, pad)], dim=1)
        prev, docs = docs[:, :-1].reshape(bsz, 1, n, chunk_size)[..., :1], docs[:, 1:].reshape(bsz, 1, n, chunk_size)
        mask = mask & (docs[..., :, None] == docs[..., None, :])
        reads = reads * (docs == prev)[..., None]
        writes = writes * (docs == docs[..., -1:])[..., None]
        carry = carry * (docs[..., -1:] == prev)
    decay = None if channels else (cum - cum.transpose(-1, -2)).masked_fill(~mask, float("-inf")).exp()

    def decayed(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """sum over channels of x_i y_j decayed from j to i, for j <= i in the same document (0 elsewhere)."""
        if not channels:
            return (x @ y.transpose(-1, -2)) * decay
        return channel_decayed(x, y, cum, mask)

    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # (I + A) u = v_beta, (I + A) w = decayed k_beta, A strictly lower: the chunk's delta-rule updates solved at once
    system = decayed(k_beta, k).tril(-1) + torch.eye(chunk_size, device=q.device)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * reads, upper=False, unitriangular=True)
    attn = decayed(q, k)
    q_read, k_write = q * reads, k * writes
    s = q.new_zeros(bsz, heads, dk, dv) if state is None else state.float()
    out, s = (scan or delta_scan)(u, w, q_read, attn, k_write, carry, s)
    out = out.reshape(bsz, heads, -1, dv)[:, :, :seq]
    return out.transpose(1, 2).to(dtype), s


def channel_decayed(x: torch.Tensor, y: torch.Tensor, cum: torch.Tensor, mask: torch.Tensor,
                    sub: int = 16) -> torch.Tensor:
    """[..., c, c]: sum over channels d of x[i, d] y[j, d] exp(cum[i, d] - cum[j, d]) where `mask` [.., c, c] holds
    (j <= i, same document), a chunk's pairs under a decay per key channel (x, y, cum [..., c, dk], cum the log decay
    from the chunk's start, non-increasing). Pairs within a sub-chunk of `sub` positions take their pairwise decays
    ([.., sub, sub, dk] per sub-chunk, not [c, c, dk] per chunk); pairs across sub-chunks factor the decay at the
    later sub-chunk's start r, exp(cum_i - r) exp(r - cum_j), both at most 1 (fla's sub-chunking), so they are
    matrix products."""
    c = x.shape[-2]
    sub = sub if c % sub == 0 else c
    parts, cums = x.unflatten(-2, (-1, sub)), cum.unflatten(-2, (-1, sub))  # [.., m, sub, dk]
    pairs = (cums[..., :, None, :] - cums[..., None, :, :]).masked_fill(
        ~torch.ones(sub, sub, dtype=torch.bool, device=x.device).tril()[..., None], float("-inf")).exp()
    within = torch.einsum("...aid,...ajd,...aijd->...aij", parts, y.unflatten(-2, (-1, sub)), pairs)
    rows = [F.pad(block, (a * sub, c - (a + 1) * sub)) for a, block in enumerate(within.unbind(-3))]
    for a in range(1, c // sub):
        start = cum[..., a * sub - 1:a * sub, :]  # the decay up to the sub-chunk's start
        later = parts[..., a, :, :] * (cums[..., a, :, :] - start).exp()
        earlier = y[..., :a * sub, :] * (start - cum[..., :a * sub, :]).exp()
        rows[a] = rows[a] + F.pad(later @ earlier.transpose(-1, -2), (0, c - a * sub))
    return torch.cat(rows, dim=-2) * mask


def delta_scan(u: torch.Tensor, w: torch.Tensor, q_read: torch.Tensor, attn: torch.Tensor, k_write: torch.Tensor,
               carry: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan across chunks (all [batch, heads, chunks, chunk, ...], `carry` [batch, heads, chunks, dk or 1]; `s`
    the state before the first): each chunk reads the state, corrects it and carries it on. -> (out [batch, heads,
    chunks, chunk, dv], final state)"""
    outs = []
    # unbound once: indexing chunk i in the loop would make backward allocate a whole-size gradient per chunk
    for u_i, w_i, q_i, attn_i, k_i, carry_i in zip(*(x.unbind(2) for x in (u, w, q_read, attn, k_write, carry)),
                                                   strict=True):
        new = u_i - w_i @ s  # each position's correction of what the state predicts
        outs.append(q_i @ s + attn_i @ new)
        s = s * carry_i[..., None] + k_i.transpose(-1, -2) @ new
    return torch.stack(outs, dim=2), s


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor | None = None,
                               documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same, a token at a time (decoding steps, and the oracle the chunked form is tested against)."""
    dtype, (bsz, seq, heads, dk), dv = v.dtype, k.shape, v.shape[-1]
    q, k, v, g, beta = (x.float() for x in (q * dk ** -0.5, k, v, g if g.dim() == 4 else g[..., None], beta))
    s = q.new_zeros(bsz, heads, dk, dv) if state is None else state.float()
    outs = []
    for t in range(seq):
        decay = g[:, t].exp()  # [batch, heads, dk or 1]
        if documents is not None and t:
            decay = decay * (documents[:, t] == documents[:, t - 1])[:, None, None]
        s = s * decay[..., None]
        delta = (v[:, t] - (s * k[:, t, ..., None]).sum(-2)) * beta[:, t, :, None]
        s = s + k[:, t, ..., None] * delta[..., None, :]
        outs.append((s * q[:, t, ..., None]).sum(-2))
    return torch.stack(outs, dim=1).to(dtype), s


def fla_available(device: torch.device, module: str = "fla.ops.gated_delta_rule") -> bool:
    if device.type != "cuda":
        return False
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _fla_delta_rule(module: str, kernel: str, q, k, v, g, beta, state, documents):
    """fla's chunked kernel `kernel` of `module` (Triton, CUDA). Packed documents: all rows' documents as one varlen
    batch."""
    fla_chunk = getattr(importlib.import_module(module), kernel)
    if documents is None:
        return fla_chunk(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=state, output_final_state=True)
    bsz, seq = documents.shape
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    offsets = torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([bsz * seq], device=q.device)])

    def flat(x):
        return x.reshape(1, bsz * seq, *x.shape[2:])

    out, final = fla_chunk(flat(q), flat(k), flat(v), flat(g), flat(beta), scale=q.shape[-1] ** -0.5,
                           output_final_state=False, cu_seqlens=offsets)
    return out.reshape(bsz, seq, *out.shape[2:]), final


class DeltaNetCache(nn.Module):
    """One DeltaNet layer's decoding state: the convolution's last K - 1 inputs and the delta-rule state."""

    def __init__(self, batch: int, kernel: int, channels: int, heads: int, dk: int, dv: int, dtype, device=None):
        super().__init__()
        self.register_buffer("conv", torch.zeros(batch, kernel - 1, channels, dtype=dtype, device=device))
        self.register_buffer("state", torch.zeros(batch, heads, dk, dv, dtype=torch.float32, device=device))
        self.length = 0


class DeltaHeads(nn.Module):
    """The parameters with a row per channel or value head (the convolution's taps, the decay's A and dt bias):
    one module, so tensor parallelism splits them by head (tessera.parallel.tp.ShardedByHead)."""

    def __init__(self, key_dim: int, value_dim: int, v_heads: int, kernel: int, dt_rows: int = 0):
        """`dt_rows`: the dt bias's rows, one per value head by default (KDA's: one per key channel)."""
        super().__init__()
        self.conv_q = nn.Parameter(torch.empty(key_dim, kernel))
        self.conv_k = nn.Parameter(torch.empty(key_dim, kernel))
        self.conv_v = nn.Parameter(torch.empty(value_dim, kernel))
        self.A_log = nn.Parameter(torch.empty(v_heads))
        self.dt_bias = nn.Parameter(torch.empty(dt_rows or v_heads))


class DeltaRule(nn.Module):
    """The mixer's per-head part, between its in-projections and its gated norm: the causal convolution, the
    L2-normed q and k, beta and the decay, and the delta rule along the sequence. Its per-token inputs split by
    head along their last dim and the per-head parameters it is handed along their first; it holds none of its
    own, so context parallelism can swap it for one that runs a head group's whole sequences
    (tessera.parallel.cp.UlyssesHeads). `scan`: its scan across chunks (see chunk_gated_delta_rule)."""

    scan = staticmethod(delta_scan)
    conv = staticmethod(causal_conv)  # and its convolution and chunked rule, for a context-parallel wrapper
    chunked = staticmethod(chunk_gated_delta_rule)  # (tessera.parallel.cp.StatePassing) to run on its chunks
    fla = ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")  # fla's module and kernel of this rule

    def __init__(self, dk: int, dv: int):
        super().__init__()
        self.dk, self.dv = dk, dv

    def forward(self, inputs: list[torch.Tensor], heads: list[torch.Tensor], documents: torch.Tensor | None = None,
                cache: DeltaNetCache | None = None, chunk_size: int = 64, fla: bool = False) -> torch.Tensor:
        """inputs: q, k, v before the convolution [batch, seq, heads x head dim], the decay's input a and beta's
        logit b [batch, seq, value heads]; heads: the taps of q, k and v [channels, K], A_log and dt_bias [value
        heads]. -> [batch, seq, value heads, dv]."""
        q, k, v, a, b = inputs
        *taps, a_log, dt_bias = heads
        seq = q.shape[1]
        qkv = torch.cat([q, k, v], dim=-1)
        conv = causal_conv(qkv, torch.cat(taps), documents, cache.conv if cache is not None else None)
        if cache is not None:
            past = torch.cat([cache.conv, qkv.to(cache.conv.dtype)], dim=1)
            cache.conv.copy_(past[:, past.shape[1] - cache.conv.shape[1]:])
        q, k, v, g, beta = self.gates(conv, [len(t) for t in taps], a, b, a_log, dt_bias)
        state = cache.state if cache is not None else None
        if fla:
            out, final = _fla_delta_rule(*self.fla, q, k, v.float(), g, beta, state, documents)
        elif cache is not None and seq < chunk_size:
            out, final = recurrent_gated_delta_rule(q, k, v, g, beta, state, documents)
        else:
            out, final = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size, state, documents, self.scan)
        if cache is not None:
            cache.state.copy_(final)
            cache.length += seq
        return out

    def gates(self, conv: torch.Tensor, sizes: list[int], a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The convolved q, k, v (channels of `sizes`) -> q, k (L2-normed, one per value head), v per head, the log
        decay g and beta, the delta rule's inputs."""
        q, k, v = conv.split(sizes, dim=-1)
        q, k = l2norm(q.unflatten(-1, (-1, self.dk)).float()), l2norm(k.unflatten(-1, (-1, self.dk)).float())
        v = v.unflatten(-1, (-1, self.dv))
        groups = v.shape[2] // q.shape[2]
        if groups > 1:
            q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
        beta = b.float().sigmoid()
        g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
        return q, k, v, g, beta


class ChannelGatedRule(DeltaRule):
    """Kimi Delta Attention's rule (Kimi Linear): the gated delta rule with a decay per key channel, not per head,
    g = -exp(A_log) softplus(f + dt_bias) with f [batch, seq, heads x dk] (its low-rank projection) and dt_bias per
    channel; q, k and v have the same heads. Its inputs and parameters split by head as DeltaRule's, so TP and both
    kinds of CP run it alike."""

    fla = ("fla.ops.kda", "chunk_kda")

    def gates(self, conv: torch.Tensor, sizes: list[int], a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = conv.split(sizes, dim=-1)
        q, k = l2norm(q.unflatten(-1, (-1, self.dk)).float()), l2norm(k.unflatten(-1, (-1, self.dk)).float())
        rate = a_log.float().exp()[:, None]  # [heads, 1]
        g = -rate * F.softplus((a.float() + dt_bias.float()).unflatten(-1, (-1, self.dk)))
        return q, k, v.unflatten(-1, (-1, self.dv)), g, b.float().sigmoid()


class LinearMixer(nn.Module):
    """What a linear-attention mixer (Gated DeltaNet, KDA) computes with, set from its family's options
    (tessera.models.common.linear_options)."""

    chunk_size = 64  # the chunked form's block of tokens (the family's option sets it)
    kernel = "auto"  # auto: fla on CUDA when installed, else torch; torch; fla
    label = "Gated DeltaNet"  # its name in the line saying which kernel runs
    fla_module = DeltaRule.fla[0]  # its rule's fla module (the rule itself may be wrapped by context parallelism)

    def uses_fla(self, device: torch.device) -> bool:
        return self.kernel != "torch" and fla_available(device, self.fla_module)

    def new_cache(self, batch: int, dtype: torch.dtype, device=None) -> DeltaNetCache:
        """Its decoding state (a mixer has `heads`, a DeltaHeads, `conv_kernel`, `dk` and `dv`)."""
        channels = sum(t.shape[0] for t in (self.heads.conv_q, self.heads.conv_k, self.heads.conv_v))
        return DeltaNetCache(batch, self.conv_kernel, channels, self.heads.A_log.shape[0], self.dk, self.dv, dtype,
                             device)


class GatedDeltaNet(LinearMixer):
    """The mixer: wq/wk/wv (then, in `rule`, the causal conv and the delta rule), wz (the output gate), wb (beta),
    wa (the decay's input), `norm` (RMSNorm over each head's value dim, weight 1-centred as the gate's) and wo.
    Value heads are a multiple of key heads; each q/k head serves v_heads / k_heads consecutive value heads."""

    def __init__(self, dim: int, k_heads: int, v_heads: int, dk: int, dv: int, conv_kernel: int, eps: float):
        super().__init__()
        self.dk, self.dv, self.conv_kernel = dk, dv, conv_kernel
        self.wq = nn.Linear(dim, k_heads * dk, bias=False)
        self.wk = nn.Linear(dim, k_heads * dk, bias=False)
        self.wv = nn.Linear(dim, v_heads * dv, bias=False)
        self.wz = nn.Linear(dim, v_heads * dv, bias=False)
        self.wb = nn.Linear(dim, v_heads, bias=False)
        self.wa = nn.Linear(dim, v_heads, bias=False)
        self.heads = DeltaHeads(k_heads * dk, v_heads * dv, v_heads, conv_kernel)
        self.rule = DeltaRule(dk, dv)
        self.norm = nn.RMSNorm(dv, eps=eps)
        self.wo = nn.Linear(v_heads * dv, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None, cache: DeltaNetCache | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """x [batch, seq, dim]; `rope` is not used (the signature is attention's); `cache`: the state after the
        earlier positions, updated; `documents` [batch, seq]: the state resets where the document changes."""
        h = self.heads
        heads = [local(t) for t in (h.conv_q, h.conv_k, h.conv_v, h.A_log, h.dt_bias)]
        inputs = [self.wq(x), self.wk(x), self.wv(x), self.wa(x), self.wb(x)]
        out = self.rule(inputs, heads, documents, cache, chunk_size=self.chunk_size, fla=self.uses_fla(x.device))
        z = self.wz(x).unflatten(-1, (-1, self.dv))
        out = self.norm(out.to(x.dtype)) * F.silu(z.float()).to(x.dtype)
        return self.wo(out.flatten(2))
