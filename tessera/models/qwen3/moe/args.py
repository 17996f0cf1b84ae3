"""Qwen 3 MoE hyper-parameters (published configs): Qwen 3 dense args (the same model line, so its table's
fields) plus the experts, and which blocks have them (transformers' decoder_sparse_step and mlp_only_layers; the
published models have experts in every block)."""

import dataclasses
from dataclasses import InitVar, dataclass, field

from tessera.models.common.moe_args import MoEArgs, sparse_layers
from tessera.models.qwen3.args import Qwen3Args


@dataclass
class Qwen3MoeArgs(Qwen3Args):
    n_experts: int = 128
    top_k: int = 8
    moe_hidden: int = 768  # each expert's SwiGLU hidden size
    norm_topk_prob: bool = True  # renormalize the top-k router weights
    sparse_step: int = 1  # HF decoder_sparse_step: blocks step-1, 2 step-1, ... have experts
    dense_layers: list[int] = field(default_factory=list)  # HF mlp_only_layers: a dense SwiGLU of ffn_hidden instead
    first_k_dense: InitVar[int] = 0  # model.json records before dense_layers: blocks 0..k-1 dense

    def __post_init__(self, first_k_dense: int):
        self.dense_layers = sorted({*self.dense_layers, *range(first_k_dense)})

    @property
    def moe(self) -> MoEArgs:
        return MoEArgs(n_experts=self.n_experts, top_k=self.top_k, hidden=self.moe_hidden,
                       route_norm=self.norm_topk_prob,
                       layers=sparse_layers(self.n_layers, self.sparse_step, self.dense_layers))

    def arch(self) -> dict:
        """The blocks with experts as one list: a step and a list of dense blocks that pick the same ones agree."""
        layers = self.moe.layers
        unused = ("max_seq_len", "sparse_step", "dense_layers") + (() if len(layers) < self.n_layers
                                                                   else ("ffn_hidden",))  # no dense block, no width
        return {**{k: v for k, v in dataclasses.asdict(self).items() if k not in unused}, "moe_layers": list(layers)}


# name: dim, layers, heads, kv heads, head_dim, experts, top-k, expert hidden, dense first blocks (of ffn_hidden 192)
_TABLE = {
    "debugmodel_moe": (64, 2, 4, 2, 16, 8, 2, 32, 0),  # for tests and CPU runs
    "debugmodel_moe_dense_first": (64, 2, 4, 2, 16, 8, 2, 32, 1),  # a pipeline stage without experts, for tests
    "30B-A3B": (2048, 48, 32, 4, 128, 128, 8, 768, 0),
    "235B-A22B": (4096, 94, 64, 4, 128, 128, 8, 1536, 0),
}
FLAVORS = {name: Qwen3MoeArgs(dim=d, n_layers=n, n_heads=h, n_kv_heads=kv, head_dim=hd, n_experts=e, top_k=k,
                              moe_hidden=mh, dense_layers=list(range(fk)),
                              ffn_hidden=192 if fk else Qwen3Args.ffn_hidden)
           for name, (d, n, h, kv, hd, e, k, mh, fk) in _TABLE.items()}
TAKES_TOKENIZER_VOCAB = {"debugmodel_moe", "debugmodel_moe_dense_first"}
