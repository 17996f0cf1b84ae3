"""Mixture-of-experts hyper-parameters a family's args carry (torch-free, so configs are checked before launch).
How a run balances and computes them (training settings, not architecture) is the `moe` config section."""

from collections.abc import Iterable
from dataclasses import dataclass


def sparse_layers(n_layers: int, step: int = 1, dense: Iterable[int] = (),
                  listed: Iterable[int] | None = None) -> tuple[int, ...]:
    """The blocks whose FFN is a mixture of experts, as transformers picks them: those `listed` (Llama 4's
    moe_layers) when given, else every `step`-th block (layers step-1, 2 step-1, ...: Qwen 3 MoE's
    decoder_sparse_step, Llama 4's interleave_moe_layer_step) but those in `dense` (Qwen 3 MoE's mlp_only_layers,
    DeepSeek's first_k_dense_replace blocks). The one list of a model that its blocks, counts, layout checks and
    cost estimates read."""
    if listed is not None:
        return tuple(sorted(set(listed)))
    dense = set(dense)
    return tuple(i for i in range(n_layers) if (i + 1) % step == 0 and i not in dense)


@dataclass
class MoEArgs:
    n_experts: int = 8
    top_k: int = 2
    hidden: int = 256  # each routed expert's SwiGLU hidden size
    n_shared: int = 0  # shared experts (one dense SwiGLU of n_shared x hidden, added for every token)
    score_func: str = "softmax"  # router scores: softmax, sigmoid or sqrtsoftplus (DeepSeek V4); computed in fp32
    route_norm: bool = True  # renormalize the top-k weights to sum to 1
    route_scale: float = 1.0  # then scale them
    n_groups: int = 1  # group-limited routing: experts in n_groups groups, tokens choose within top_groups of them
    top_groups: int = 1
    score_before_experts: bool = False  # weight the expert's input, not its output (Llama 4)
    layers: tuple[int, ...] | None = None  # the blocks with this MoE (sparse_layers); the others keep a dense SwiGLU
    # of the decoder's ffn_hidden. None: every block
    bias: bool = False  # biases on the router and the experts' projections (GPT-OSS)
    swiglu_limit: float = 0.0  # GPT-OSS's clamped SwiGLU: gate <= limit, |up| <= limit, then
    swiglu_alpha: float = 1.702  # gate * sigmoid(alpha * gate) * (up + up_shift); limit 0: plain silu(gate) * up
    swiglu_up_shift: float = 1.0  # (DeepSeek V4's: alpha 1, shift 0, the shared experts clamped too)
    clamp_shared: bool = False  # the shared experts' SwiGLU clamped at swiglu_limit as well
    hash_vocab: int = 0  # hash routing (DeepSeek V4's first blocks): a fixed table of top_k experts per token id
    # of this vocabulary picks them, the router only weighs them; 0: the router picks
    hash_seed: int = 0  # seeds the table dealt when training starts from scratch (a block's own)

    def sparse(self, layer_id: int) -> bool:
        return self.layers is None or layer_id in self.layers

    def n_sparse(self, n_layers: int) -> int:
        """How many of the first `n_layers` blocks are MoE."""
        return n_layers if self.layers is None else sum(i < n_layers for i in self.layers)
