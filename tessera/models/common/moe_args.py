"""Mixture-of-experts hyper-parameters a family's args carry (torch-free, so configs are checked before launch).
How a run balances and computes them (training settings, not architecture) is the `moe` config section."""

from dataclasses import dataclass


@dataclass
class MoEArgs:
    n_experts: int = 8
    top_k: int = 2
    hidden: int = 256  # each routed expert's SwiGLU hidden size
    n_shared: int = 0  # shared experts (one dense SwiGLU of n_shared x hidden, added for every token)
    score_func: str = "softmax"  # router scores: softmax or sigmoid (computed in fp32)
    route_norm: bool = True  # renormalize the top-k weights to sum to 1
    route_scale: float = 1.0  # then scale them
    n_groups: int = 1  # group-limited routing: experts in n_groups groups, tokens choose within top_groups of them
    top_groups: int = 1
    score_before_experts: bool = False  # weight the expert's input, not its output (Llama 4)
    first_k_dense: int = 0  # the first k blocks keep a dense SwiGLU (the decoder's ffn_hidden) instead
    bias: bool = False  # biases on the router and the experts' projections (GPT-OSS)
    swiglu_limit: float = 0.0  # GPT-OSS's clamped SwiGLU: gate <= limit, |up| <= limit, then
    swiglu_alpha: float = 1.702  # gate * sigmoid(alpha * gate) * (up + 1); limit 0: plain silu(gate) * up
