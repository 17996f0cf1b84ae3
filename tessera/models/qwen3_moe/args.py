"""Qwen 3 MoE hyper-parameters (published configs): Qwen 3 dense args (the same model line, so its table's
fields) plus the experts; every FFN is a mixture of experts."""

import dataclasses
from dataclasses import dataclass

from tessera.models.common.moe_args import MoEArgs
from tessera.models.qwen3.args import Qwen3Args


@dataclass
class Qwen3MoeArgs(Qwen3Args):
    n_experts: int = 128
    top_k: int = 8
    moe_hidden: int = 768  # each expert's SwiGLU hidden size
    norm_topk_prob: bool = True  # renormalize the top-k router weights
    first_k_dense: int = 0  # the first k blocks keep a dense SwiGLU of ffn_hidden (HF: mlp_only_layers 0..k-1)

    @property
    def moe(self) -> MoEArgs:
        return MoEArgs(n_experts=self.n_experts, top_k=self.top_k, hidden=self.moe_hidden,
                       route_norm=self.norm_topk_prob, first_k_dense=self.first_k_dense)

    def arch(self) -> dict:
        unused = ("max_seq_len",) + (() if self.first_k_dense else ("ffn_hidden",))  # no dense block, no width
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in unused}


# name: dim, layers, heads, kv heads, head_dim, experts, top-k, expert hidden, dense first blocks (of ffn_hidden 192)
_TABLE = {
    "debugmodel_moe": (64, 2, 4, 2, 16, 8, 2, 32, 0),  # for tests and CPU runs
    "debugmodel_moe_dense_first": (64, 2, 4, 2, 16, 8, 2, 32, 1),  # a pipeline stage without experts, for tests
    "30B-A3B": (2048, 48, 32, 4, 128, 128, 8, 768, 0),
    "235B-A22B": (4096, 94, 64, 4, 128, 128, 8, 1536, 0),
}
FLAVORS = {name: Qwen3MoeArgs(dim=d, n_layers=n, n_heads=h, n_kv_heads=kv, head_dim=hd, n_experts=e, top_k=k,
                              moe_hidden=mh, first_k_dense=fk, ffn_hidden=192 if fk else Qwen3Args.ffn_hidden)
           for name, (d, n, h, kv, hd, e, k, mh, fk) in _TABLE.items()}
TAKES_TOKENIZER_VOCAB = {"debugmodel_moe", "debugmodel_moe_dense_first"}
