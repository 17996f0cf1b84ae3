"""Qwen3-Next hyper-parameters and flavors: Qwen 3.5's hybrid blocks (the lineage's first release), whose FFN is a
mixture of experts with a gated shared expert in every `decoder_sparse_step`-th block but those in
`mlp_only_layers` (a SwiGLU of `ffn_hidden` there), the top-k weights renormalized only when `norm_topk_prob`.
Torch-free.

"80B-A3B" is Qwen/Qwen3-Next-80B-A3B's released config.json (Base, Instruct and Thinking share it): 48 blocks, one
in four full attention, 512 experts of which 10 route, every block MoE."""

import dataclasses
from dataclasses import dataclass, field

from tessera.models.common.moe_args import MoEArgs, sparse_layers
from tessera.models.qwen3_5.args import FULL, LINEAR, Qwen35MoeArgs


@dataclass
class Qwen3NextArgs(Qwen35MoeArgs):
    decoder_sparse_step: int = 1  # blocks step-1, 2 step-1, ... hold experts
    mlp_only_layers: list[int] = field(default_factory=list)  # blocks with a dense SwiGLU (ffn_hidden) instead
    norm_topk_prob: bool = True  # the top-k routing weights renormalized to sum to 1

    def __post_init__(self):
        super().__post_init__()
        self.mlp_only_layers = sorted(set(self.mlp_only_layers))
        if self.decoder_sparse_step < 1 or any(not 0 <= i < self.n_layers for i in self.mlp_only_layers):
            raise ValueError(f"decoder_sparse_step = {self.decoder_sparse_step} (>= 1) and mlp_only_layers = "
                             f"{self.mlp_only_layers} (blocks 0..{self.n_layers - 1}) pick the MoE blocks")

    @property
    def moe(self) -> MoEArgs:
        return MoEArgs(n_experts=self.n_experts, top_k=self.top_k, hidden=self.moe_hidden,
                       route_norm=self.norm_topk_prob, layers=self.sparse_layers)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return sparse_layers(self.n_layers, self.decoder_sparse_step, self.mlp_only_layers)

    def arch(self) -> dict:  # the dense SwiGLU's size counts only where a block has one
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "max_seq_len"}
        if len(self.sparse_layers) == self.n_layers:
            out.pop("ffn_hidden")
        return out


_RELEASED = dict(dim=2048, n_layers=48, n_heads=16, n_kv_heads=2, head_dim=256, linear_k_heads=16, linear_v_heads=32,
                 linear_k_dim=128, linear_v_dim=128, n_experts=512, top_k=10, moe_hidden=512, shared_hidden=512,
                 ffn_hidden=5120, vocab_size=151936, rope_theta=1e7)
FLAVORS = {
    # for tests and CPU runs: each of two pipeline stages holds both mixers, a dense block and a MoE one
    "debugmodel_next": Qwen3NextArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, linear_k_heads=2,
                                     linear_v_heads=4, linear_k_dim=16, linear_v_dim=16, n_experts=8, top_k=2,
                                     moe_hidden=32, shared_hidden=32, ffn_hidden=96, rope_theta=1e7,
                                     layer_types=[LINEAR, FULL, LINEAR, FULL], decoder_sparse_step=2),
    "80B-A3B": Qwen3NextArgs(**_RELEASED),
}
TAKES_TOKENIZER_VOCAB = {"debugmodel_next"}
