"""Multi-token prediction (DeepSeek V3 section 2.2; V4's MTPBlock) as the group's decoders train it: depth k, from
the previous depth's state (the trunk's for k = 1) and the embeddings of the tokens k further on, makes the input
of the shared head at each slot, its loss the cross-entropy against the token k + 1 further on; the depths' mean
loss is a side loss (`mtp_loss`) attached to the main output. What a depth passes on and what the head reads
differ by family (`trunk_out`, a depth's forward): V3's normed hidden states are both, V4's depth passes on its
residual streams and collapses them for the head."""

import torch
import torch.nn.functional as F

from tessera.models.common.side_loss import Lookahead

IGNORE = -100  # the label of a position that is not trained (tessera.data.masks's)


class MTPDecoder:
    """A mixin before the Decoder: `mtp` (a ModuleDict of depths, or None), `mtp_loss` (SideLoss), `lookahead`
    (Lookahead) set by the subclass; `trunk_out(h)` -> (state the first depth takes, the head's input) of the last
    block's output; `plain_forward`, the forward without the depths. A depth's forward (state, embeddings, rope,
    documents) -> (state the next depth takes, its head's input)."""

    side_loss_labels = True  # the MTP loss trains only where the labels do: it needs them also unchunked

    def forward(self, tokens: torch.Tensor, cache: list | None = None, documents: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.carries_embeddings():
            return self.stage_forward(tokens, documents, positions, labels)
        if not (self.training and self.mtp is not None and self.mtp_loss.weight and cache is None):
            return self.plain_forward(tokens, cache, documents, positions, labels)
        state, h = self.trunk_out(self.hidden(tokens, documents=documents, positions=positions))
        return self.with_mtp(state, h, None, tokens, documents, positions, labels)

    def carries_embeddings(self) -> bool:
        """Whether this is a pipeline stage (it lacks the embedding or the final norm) of a model that trains its
        MTP depths: then what passes between stages is [hidden state; input embeddings] (dim wider), so that the
        depths, on the last stage, get the embeddings of the whole sequence from the first stage, and their
        gradient goes back to the embedding the way the hidden states' does (no copy of it to keep in step)."""
        return bool(self.args.n_mtp and self.mtp_loss.weight) and (self.tok_embeddings is None or self.norm is None)

    def stream_width(self) -> int:
        return self.trunk_width() + (self.args.dim if self.carries_embeddings() else 0)

    def trunk_width(self) -> int:
        return self.args.dim

    def stage_forward(self, x: torch.Tensor, documents: torch.Tensor | None, positions: torch.Tensor | None,
                      labels: torch.Tensor | None) -> torch.Tensor:
        """One pipeline stage's forward (see carries_embeddings): the first takes the tokens, the others the
        stream; the last returns what forward does, the depths run only while they train (the trainer's view of
        the stages switches them to eval, not the stage itself)."""
        if self.tok_embeddings is not None:
            embeddings = self.tok_embeddings(x)
        else:
            x, embeddings = x.split([self.trunk_width(), self.args.dim], dim=-1)
        h = self.hidden(x, documents=documents, positions=positions)
        if self.norm is None:
            return torch.cat([h, embeddings], dim=-1)
        state, h = self.trunk_out(h)
        if not self.mtp.training:
            return self.head(h) if labels is None else self.token_loss(h, labels)
        return self.with_mtp(state, h, embeddings, None, documents, positions, labels)

    def with_mtp(self, state: torch.Tensor, h: torch.Tensor, embeddings: torch.Tensor | None,
                 tokens: torch.Tensor | None, documents: torch.Tensor | None, positions: torch.Tensor | None,
                 labels: torch.Tensor | None) -> torch.Tensor:
        """The head's output (or the token loss, given labels) of the head's input `h`, the depths' weighted loss
        attached to it; `state`: what the first depth takes. `tokens`: the targets without labels (a pipeline
        passes labels)."""
        # Depth k at slot i predicts token i+k+1, the target of label i+k: its inputs hold the last target but
        # one, so each depth's slots from seq - k - 1 on (whose targets are the window's next token, or past it)
        # are left out of its loss. Given labels, a depth trains where label i+k does (not on prompts, nor where a
        # document starts), its loss the mean over those targets of the micro-batch, whichever ranks hold them (0
        # when none); without labels, on the tokens.
        # The targets are read ahead on the whole sequence, so that they cross CP ranks' chunks.
        # Under pipelining `embeddings` are the first stage's, carried to the last (see carries_embeddings).
        depths = enumerate(self.mtp_hidden(state, tokens, documents, positions, embeddings), 1)
        ahead = self.lookahead.ahead
        if labels is None:
            losses = [F.cross_entropy(self.head(out).flatten(0, 1).float(), ahead(tokens, k + 1, IGNORE).flatten(),
                                      ignore_index=IGNORE) for k, out in depths]
        else:
            targets = {k: ahead(labels, k, IGNORE, end=1) for k in range(1, len(self.mtp) + 1)}
            losses = [self.token_loss(out, targets[k]) / self.lookahead.trained(targets[k]) for k, out in depths]
        main = self.head(h) if labels is None else self.token_loss(h, labels)
        return self.mtp_loss.attach(main, torch.stack(losses).mean())

    def mtp_logits(self, state: torch.Tensor, tokens: torch.Tensor, documents: torch.Tensor | None = None,
                   positions: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Each depth's logits [batch, seq - k, vocab] (k = 1, 2...): its slots that hold tokens; see mtp_hidden."""
        out = self.mtp_hidden(state, tokens, documents, positions)
        return [self.head(x[:, :x.shape[1] - k]) for k, x in enumerate(out, 1)]

    def mtp_hidden(self, state: torch.Tensor, tokens: torch.Tensor | None, documents: torch.Tensor | None = None,
                   positions: torch.Tensor | None = None, embeddings: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Each depth's head input [batch, seq, dim] (k = 1, 2...), from the trunk's `state` (trunk_out's) and the
        input tokens; each depth takes the state the one before passes on. Its slot i joins the state at slot i
        with the embedding of token i + k, in slot i's document and at its position (so a packed document's depth
        slots see only states of that document, as it alone would); its last k slots, past the window, repeat the
        last token and train nothing. Whole-length, a depth's sequence splits over TP and CP like the trunk's. On a
        pipeline's last stage the inputs' `embeddings` (the first stage's, whole sequences: PP with MTP runs without
        TP and CP) are shifted instead of embedding the tokens read ahead."""
        out, ahead = [], self.lookahead.ahead
        rope = self.rope if positions is None else self.rope[positions]
        for k, depth in enumerate(self.mtp.values(), 1):
            if embeddings is None:
                inputs = self.tok_embeddings(ahead(tokens, k))
            else:  # the tokens' shift, on their embeddings (along the sequence, dim 1)
                inputs = Lookahead.shift(embeddings.transpose(1, 2), k).transpose(1, 2)
            state, h = depth(state, inputs, rope, documents)
            out.append(h)
        return out
