"""Llama 4 (text) hyper-parameters. Torch-free, so configs are checked before launch.

The published sizes are those of the `text_config` in the config.json of meta-llama/Llama-4-Scout-17B-16E and
meta-llama/Llama-4-Maverick-17B-128E (transformers' Llama4TextConfig defaults are Scout's; TorchTitan's llama4
flavors `17bx16e` and `17bx128e` agree): hidden 5120, 48 layers, 40 heads, 8 KV heads, head_dim 128, experts of
8192 (intermediate_size) and dense layers of 16384 (intermediate_size_mlp), vocab 202048, rope_theta 500000,
chunks of 8192, a NoPE layer every 4th. Scout: 16 experts in every layer, L2 q/k norm, Llama 3 RoPE scaling
(factor 16, low and high frequency factors 1, original context 8192). Maverick: 128 experts every other layer
(interleave_moe_layer_step 2, dense layers between), no q/k norm, unscaled RoPE. Both route each token to 1
expert beside the shared one.
"""

import dataclasses
from dataclasses import dataclass, field

from tessera.models.common.moe_args import MoEArgs, sparse_layers


def _scout_rope() -> dict:
    return {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192}


@dataclass
class Llama4Args:
    dim: int = 5120
    n_layers: int = 48
    n_heads: int = 40
    n_kv_heads: int = 8
    head_dim: int = 128
    ffn_hidden: int = 16384  # the dense layers' SwiGLU (HF intermediate_size_mlp)
    moe_hidden: int = 8192  # each routed expert's, and the shared expert's (HF intermediate_size)
    n_experts: int = 16
    top_k: int = 1
    moe_step: int = 1  # HF interleave_moe_layer_step: layers step-1, 2 step-1, ... are MoE, the others dense
    moe_layers: list[int] | None = None  # HF moe_layers, when not the step's
    nope_interval: int = 4  # HF no_rope_layer_interval: layers 3, 7, ... have no RoPE (and attend in full)
    rope_layers: list[int] | None = None  # HF no_rope_layers (1: RoPE, 0: NoPE), when not the interval's
    chunk: int = 8192  # HF attention_chunk_size: RoPE layers attend within chunks of this many positions; 0: all
    qk_norm_l2: bool = True  # HF use_qk_norm: RoPE layers normalize q and k (RMS, no weight) after RoPE
    temperature_tuning: bool = True  # HF attn_temperature_tuning: NoPE layers scale queries up with position
    floor_scale: int = 8192  # ... by 1 + attn_scale * log(1 + floor((position + 1) / floor_scale))
    attn_scale: float = 0.1
    vocab_size: int = 202048  # debugmodel takes the tokenizer's instead
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: dict | None = field(default_factory=_scout_rope)  # as transformers' rope_parameters
    max_seq_len: int = 8192  # length of the RoPE table; set from training.seq_len
    tie_embeddings: bool = False

    qk_norm = False  # not fields: the shared decoder's switches (no learned q/k norm, no biases)
    attention_bias = False

    def uses_rope(self, layer_id: int) -> bool:
        if self.rope_layers is not None:
            return bool(self.rope_layers[layer_id])
        return not self.nope_interval or (layer_id + 1) % self.nope_interval != 0

    def is_moe(self, layer_id: int) -> bool:
        return layer_id in self.moe.layers

    def chunked(self, layer_id: int) -> bool:
        return bool(self.chunk) and self.uses_rope(layer_id)

    @property
    def moe(self) -> MoEArgs:
        """Top-k of sigmoid scores (the same experts as top-k of the logits), unnormalized, weighting each
        expert's input; one shared expert of the routed ones' size."""
        return MoEArgs(n_experts=self.n_experts, top_k=self.top_k, hidden=self.moe_hidden, n_shared=1,
                       score_func="sigmoid", route_norm=False, score_before_experts=True,
                       layers=sparse_layers(self.n_layers, self.moe_step, listed=self.moe_layers))

    def arch(self) -> dict:
        unused = ("max_seq_len",) + (() if len(self.moe.layers) < self.n_layers else ("ffn_hidden",))
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in unused}


# name: dim, layers, heads, kv heads, head_dim, dense hidden, expert hidden, experts, top-k, MoE step, chunk,
# L2 q/k norm, temperature floor_scale, Scout's RoPE scaling, vocab
_TABLE = {
    # Tests and CPU runs: NoPE layer 3, MoE in layers 1 and 3; chunks and temperature steps short enough to
    # bite in sequences of 32 (chunks not aligned with context parallel's pieces of 8 or 4).
    "debugmodel": (64, 4, 4, 2, 16, 128, 32, 8, 1, 2, 12, True, 8, True, 0),
    "17bx16e": (5120, 48, 40, 8, 128, 16384, 8192, 16, 1, 1, 8192, True, 8192, True, 202048),  # Scout
    "17bx128e": (5120, 48, 40, 8, 128, 16384, 8192, 128, 1, 2, 8192, False, 8192, False, 202048),  # Maverick
}
FLAVORS = {name: Llama4Args(dim=d, n_layers=n, n_heads=h, n_kv_heads=kv, head_dim=hd, ffn_hidden=f, moe_hidden=mh,
                            n_experts=e, top_k=k, moe_step=step, chunk=c, qk_norm_l2=l2, floor_scale=fs,
                            rope_scaling=_scout_rope() if scaled else None, vocab_size=vocab)
           for name, (d, n, h, kv, hd, f, mh, e, k, step, c, l2, fs, scaled, vocab) in _TABLE.items()}
TAKES_TOKENIZER_VOCAB = {"debugmodel"}
