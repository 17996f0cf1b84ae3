"""Flux (FLUX.1 schnell and dev): a rectified-flow text-to-image transformer of double-stream and single-stream
blocks over patchified VAE latents, conditioned on T5 sequence features and a pooled CLIP embedding. It brings its
own data (image-caption pairs encoded by frozen text encoders and an autoencoder), batch, loss and evaluation."""

from tessera.models.contract import Counts, Family
from tessera.models.flux import hf
from tessera.models.flux.args import FLAVORS
from tessera.models.flux.checks import check
from tessera.models.flux.options import FluxOptions


def counts(args, seq_len: int) -> Counts:
    """Parameters, and training FLOPs per token of the joint (text + image) sequence of `seq_len` tokens: 6 per
    weight a token meets (in a double block only its own stream's), plus attention scores and values, 12 x dim per
    key (all S keys, bidirectional). The per-sample conditioning (timestep, pooled text, modulation) is left out:
    it runs once per image, not per token. Text encoders and the autoencoder are not counted (frozen, and
    skipped entirely with cached latents)."""
    a, d, mlp, hd = args, args.dim, args.mlp_hidden, args.head_dim
    linear = lambda i, o: i * o + o  # noqa: E731
    stream = 4 * linear(d, d) + 2 * hd + linear(d, mlp) + linear(mlp, d) + linear(d, 6 * d)  # attn, norms, ff, adaLN
    double = 2 * stream
    single = 3 * linear(d, d) + 2 * hd + linear(d, mlp) + linear(d + mlp, d) + linear(d, 3 * d)
    embed = linear(256, d) + linear(d, d)
    root = linear(a.in_channels, d) + linear(a.context_dim, d) + embed * (2 if a.guidance_embed else 1) \
        + linear(a.pooled_dim, d) + linear(d, d) + linear(d, 2 * d) + linear(d, a.in_channels)
    params = a.n_double * double + a.n_single * single + root
    per_token = a.n_double * (4 * d * d + 2 * d * mlp) + a.n_single * (3 * d * d + d * mlp + (d + mlp) * d) \
        + 2 * a.in_channels * d
    flops = 6 * per_token + 12 * a.n_layers * d * seq_len
    return Counts(params=params, active=params, embedding=0, flops_per_token=flops)


def check_layout(args, tp: int, cp: int, pp: int, label: str) -> None:
    if tp > 1:
        raise ValueError(f"parallelism.tensor_parallel_degree: {label} is trained with FSDP/HSDP and CP, not TP: "
                         f"its 12B parameters fit under FSDP on one 8-GPU node and an image's 4.6k tokens are short, "
                         f"so TP's per-layer collectives would cost more than they save; set it to 1")
    if pp > 1:
        raise ValueError(f"parallelism.pipeline_parallel_degree: {label} passes two streams and a per-sample "
                         f"conditioning vector between blocks, which pipeline stages do not carry; use FSDP/CP")


FAMILY = Family(name="flux", flavors=FLAVORS, takes_tokenizer_vocab=frozenset(), hf=hf, counts=counts,
                check_layout=check_layout, embedding="x_embedder.weight", output="proj_out.weight",
                high_precision=("proj_out",),
                torch_side="tessera.models.flux.spec:SPEC", hf_model_type=hf.CLASS_NAME,
                options=FluxOptions, check=check, own_data=True, lora=False)
