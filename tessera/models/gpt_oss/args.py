"""GPT-OSS hyper-parameters (published configs): GQA with biases and learned sinks, layers alternating a sliding
window with full causal attention, and a biased MoE with the clamped SwiGLU. Torch-free, so configs are checked
before launch."""

import dataclasses
from dataclasses import dataclass, field

from tessera.models.common.moe_args import MoEArgs

SLIDING, FULL = "sliding_attention", "full_attention"


def _yarn() -> dict:
    return {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 4096}


@dataclass
class GptOssArgs:
    dim: int = 2880
    n_layers: int = 24
    n_heads: int = 64
    n_kv_heads: int = 8
    head_dim: int = 64
    n_experts: int = 32
    top_k: int = 4
    moe_hidden: int = 2880  # each expert's (HF intermediate_size)
    window: int = 128  # the keys a sliding-window layer's query sees, itself included (HF sliding_window)
    layer_types: list[str] | None = None  # per block SLIDING or FULL (HF layer_types); None: alternating, sliding first
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    vocab_size: int = 201088  # debugmodel takes the tokenizer's instead
    norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: dict | None = field(default_factory=_yarn)  # as transformers' rope_parameters
    max_seq_len: int = 4096  # length of the RoPE table; set from training.seq_len
    tie_embeddings: bool = False

    qk_norm = False  # not fields: the shared decoder's switches
    attention_bias = True
    ffn_hidden = 0  # no dense block

    def sliding(self, layer_id: int) -> bool:
        return (self.layer_types[layer_id] if self.layer_types else SLIDING if layer_id % 2 == 0 else FULL) == SLIDING

    @property
    def moe(self) -> MoEArgs:
        return MoEArgs(n_experts=self.n_experts, top_k=self.top_k, hidden=self.moe_hidden, bias=True,
                       swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha)

    def arch(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "max_seq_len"}


# name: dim, layers, heads, kv heads, head_dim, experts, top-k, expert hidden, window, vocab
_TABLE = {
    "debugmodel": (64, 4, 4, 2, 16, 8, 2, 32, 8, 0),  # tests, CPU runs: windows shorter than the sequences
    "20b": (2880, 24, 64, 8, 64, 32, 4, 2880, 128, 201088),
    "120b": (2880, 36, 64, 8, 64, 128, 4, 2880, 128, 201088),
}
FLAVORS = {name: GptOssArgs(dim=d, n_layers=n, n_heads=h, n_kv_heads=kv, head_dim=hd, n_experts=e, top_k=k,
                            moe_hidden=mh, window=w, vocab_size=vocab)
           for name, (d, n, h, kv, hd, e, k, mh, w, vocab) in _TABLE.items()}
TAKES_TOKENIZER_VOCAB = {"debugmodel"}
