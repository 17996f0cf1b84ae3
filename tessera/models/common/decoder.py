"""The decoder-only transformer the dense families share: embedding, pre-norm blocks of attention and SwiGLU,
a final norm and the output head (or the embedding matrix, tied).

Its args are any dataclass with: dim, n_layers, n_heads, n_kv_heads, head_dim, ffn_hidden, vocab_size,
norm_eps, tie_embeddings, max_seq_len, qk_norm, rope_theta, rope_scaling (a dict for rope.inv_freq, or None),
attention_bias (biases on q, k, v and o), and moe (a MoEArgs: the blocks `moe.layers` names have a mixture of
experts for FFN, the others a SwiGLU of ffn_hidden; None: SwiGLU everywhere).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.common.attention import Attention, FeedForward, KVCache, share_document_masks
from tessera.models.common.chunked_loss import chunked_cross_entropy, summed_cross_entropy
from tessera.models.common.moe import MoE
from tessera.models.common.rope import attention_factor, inv_freq, rope_table


class TransformerBlock(nn.Module):
    def __init__(self, args, layer_id: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = self.make_attention(args, layer_id)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        sparse = args.moe is not None and args.moe.sparse(layer_id)
        self.feed_forward = MoE(args.dim, args.moe) if sparse else FeedForward(args.dim, args.ffn_hidden)

    @staticmethod
    def make_attention(args, layer_id: int) -> nn.Module:
        """A family with another attention (DeepSeek's MLA, GPT-OSS's windows and sinks) overrides this;
        forward(x, rope, cache, documents)."""
        return Attention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, args.qk_norm, args.norm_eps,
                         args.attention_bias)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: KVCache | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        # Keywords: TP plans prepare the 2 positional inputs.
        x = x + self.attention(self.attention_norm(x), rope, cache=cache, documents=documents)
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    block = TransformerBlock  # a family's subclass may swap it
    # Given labels, forward returns the summed token loss, the head and loss run over this many slices of the
    # sequence (tessera/models/common/chunked_loss.py); `chunk_loss` sums one slice's (the trainer sets both).
    loss_chunks = 1
    chunk_loss = staticmethod(summed_cross_entropy)
    side_loss_labels = False  # a subclass's side loss reads the labels: the trainer passes them also unchunked

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A dict keyed by layer id keeps parameter names stable when a pipeline stage drops layers.
        self.layers = nn.ModuleDict({str(i): self.block(args, i) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # Tied: the embedding matrix is used directly, since module-level sharing does not survive to_empty().
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.rope_dim = getattr(args, "rope_dim", args.head_dim)  # MLA rotates only part of each head
        self.register_buffer("rope", torch.empty(args.max_seq_len, 2, self.rope_dim, device="meta"), persistent=False)
        share_document_masks(self)

    def init_buffers(self, device: torch.device, positions: torch.Tensor | None = None) -> None:
        """The RoPE table, at `positions` (default 0 ... max_seq_len - 1). Materializing (no `positions`), the
        MoE layers' balancing state starts at 0 too; a table remade for other positions keeps the loaded one
        (DeepSeek's expert selection bias)."""
        if positions is None:
            positions = torch.arange(self.args.max_seq_len, device=device)
            for module in self.modules():
                if isinstance(module, MoE):
                    module.reset_buffers()
        a = self.args
        freqs = inv_freq(self.rope_dim, a.rope_theta, a.rope_scaling, a.max_seq_len)
        self.rope = rope_table(positions.to(device), freqs, attention_factor(a.rope_scaling))

    def forward(self, tokens: torch.Tensor, cache: list[KVCache] | None = None,
                documents: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: [batch, seq] -> logits [batch, seq, vocab]. `cache`: one KVCache per layer, for decoding;
        `documents` [batch, seq]: each token's document number, which attention does not cross; `positions`
        [seq] or [batch, seq]: each token's position (default 0, 1, ...), e.g. its place in its document.
        `labels` [batch, seq]: the cross-entropy against them instead, summed over the trained tokens (labels -100
        are not), its logits made a chunk at a time.

        A pipeline stage lacks the modules of other stages (None): it takes and returns hidden states.
        """
        h = self.hidden(tokens, cache, documents, positions)
        if self.norm is None:
            return h
        return self.head(self.norm(h)) if labels is None else self.token_loss(self.norm(h), labels)

    def stream_width(self) -> int:
        """Features per token one pipeline stage sends the next: the residual stream's (a family may add some)."""
        return self.args.dim

    def token_loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed cross-entropy of the logits of normed hidden states `h` against `labels`, chunk by chunk."""
        return chunked_cross_entropy(self.head, h, labels, self.loss_chunks, self.chunk_loss)

    def hidden(self, tokens: torch.Tensor, cache: list[KVCache] | None = None,
               documents: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The last block's output (before the final norm)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        # The whole table, or its rows per token, picked once for every layer: attention slices a table once it
        # sees the whole sequence (under sequence parallelism the residual stream holds only a slice of it).
        rope = self.rope if positions is None else self.rope[positions]
        for i, layer in enumerate(self.layers.values()):
            h = layer(h, rope, cache=cache[i] if cache is not None else None, documents=documents)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Normed hidden states -> logits."""
        return F.linear(h, self.tok_embeddings.weight) if self.output is None else self.output(h)

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device=None) -> list[KVCache]:
        a = self.args
        return [KVCache(batch, max_len, a.n_kv_heads, a.head_dim, dtype, device) for _ in range(a.n_layers)]

    def param_init(self, name: str, full: torch.Tensor, gen: torch.Generator) -> None:
        """Fill the full (unsharded) tensor of parameter `name` in place.

        Embeddings N(0, 1); q/k/v/w1 truncated N(0, 0.02); the projections that write into the residual
        stream (wo, w2, w3) shrink with depth, 0.02 / sqrt(2 (layer + 1)), so early updates stay small;
        output N(0, dim^-1/2) truncated at 3 sigma; norms 1.
        """
        if name.endswith("norm.weight"):
            full.fill_(1.0)
        elif name.endswith("bias"):  # nn.Linear.bias, experts.w1_bias...
            full.zero_()
        elif name == "tok_embeddings.weight":
            full.normal_(0.0, 1.0, generator=gen)
        elif name == "output.weight":
            std = self.args.dim ** -0.5
            nn.init.trunc_normal_(full, 0.0, std, -3 * std, 3 * std, generator=gen)
        else:
            depth_scaled = name.endswith(("wo.weight", "w2.weight", "w3.weight"))
            std = 0.02 / math.sqrt(2 * (int(name.split(".")[1]) + 1)) if depth_scaled else 0.02
            nn.init.trunc_normal_(full, 0.0, std, -2 * std, 2 * std, generator=gen)
