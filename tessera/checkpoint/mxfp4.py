"""MXFP4 tensors of a Hugging Face checkpoint (GPT-OSS's released experts, config.json quantization_config
{"quant_method": "mxfp4"}): `<name>_blocks` [..., rows, G, 16] uint8, two FP4 (e2m1) values a byte, low nibble
first, and `<name>_scales` [..., rows, G] uint8, a power-of-two exponent (bias 127) per 32 values. Dequantized
it is [..., rows, 32 G], transposed on its last two dimensions into `<name>` as the model's adapter names it.
Each rank reads the blocks of its own experts (dimension 0) only."""

import torch
from torch.distributed.tensor import DTensor

FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS, SCALES = "_blocks", "_scales"


def packed(saved: dict) -> set[str]:
    """The names stored as blocks and scales."""
    return {n.removesuffix(BLOCKS) for n in saved if n.endswith(BLOCKS) and n.removesuffix(BLOCKS) + SCALES in saved}


def shape(saved: dict, name: str) -> tuple[int, ...]:
    """The dequantized tensor's."""
    *prefix, rows, groups, width = saved[name + BLOCKS].size
    return (*prefix, groups * width * 2, rows)


def parts(target: torch.Tensor, saved: dict, name: str) -> dict[str, torch.Tensor]:
    """Empty blocks and scales to read `name`'s into: this rank's experts of them when `target` is a DTensor."""
    out = {}
    for suffix in (BLOCKS, SCALES):
        size = tuple(saved[name + suffix].size)
        if not isinstance(target, DTensor):
            out[name + suffix] = torch.empty(size, dtype=torch.uint8, device=target.device)
            continue
        local = torch.empty((target.to_local().shape[0], *size[1:]), dtype=torch.uint8, device=target.device)
        strides = [1] * len(size)
        for i in range(len(size) - 2, -1, -1):
            strides[i] = strides[i + 1] * size[i + 1]
        out[name + suffix] = DTensor.from_local(local, target.device_mesh, target.placements, run_check=False,
                                                shape=size, stride=tuple(strides))
    return out


@torch.no_grad()
def unpack_into(target: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """target <- the dequantized values (fp32 arithmetic, exact: FP4 times a power of two)."""
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    blocks, scales, out = local(blocks), local(scales), local(target)
    lut = torch.tensor(FP4, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127).flatten(-2)
    out.copy_(values.transpose(-1, -2))
