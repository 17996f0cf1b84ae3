"""Quantized Hugging Face releases as their config.json and safetensors headers describe them (torch-free: the
launch check reads this before any rank starts): which weights are stored quantized, in which form, and the stored
tensors that hold each one. tessera.checkpoint.dequantize reads them into the model's dtype.

The forms, as transformers 5.24 reads them (tests/test_quantized_releases.py loads each in both):
- `fp8` (quantization_config quant_method "fp8", weight_block_size [b0, b1]): `<m>.weight` float8 e4m3 [R, C] beside
  its per-block scale, [ceil(R / b0), ceil(C / b1)]: `<m>.weight_scale_inv` fp32 (DeepSeek V3's, GLM-5's) or
  `<m>.scale` (DeepSeek V4's: e8m0 powers of two when scale_fmt is ue8m0). A weight is its blocks times its scale.
- `fp4` (V4's routed experts, expert_dtype fp4): `<m>.weight` int8 [R, C / 2], two e2m1 values a byte (low nibble
  first), beside `<m>.scale` [R, C / 32], one scale per 32 values of a row.
- `int` (quant_method "compressed-tensors", format pack-quantized: Kimi K2.5's INT4 experts): `<m>.weight_packed`
  int32 [R, ceil(C bits / 32)], each row's values `bits` wide packed low bits first (offset by 2^(bits-1)),
  `<m>.weight_scale` [R, G] (G groups of C / G columns), `<m>.weight_shape` [R, C], and where asymmetric
  `<m>.weight_zero_point` [ceil(R bits / 32), G] packed the same way down the rows. A weight is (value - zero) times
  its group's scale, computed in the scale's dtype (compressed-tensors' arithmetic, so that the weights are
  transformers' bit for bit)."""

import glob
import json
import math
import os
import struct
from dataclasses import dataclass

FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
_SCALES = (".weight_scale_inv", ".scale")
_INT = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")


@dataclass(frozen=True)
class Quantized:
    """One weight stored quantized: its form, its shape dequantized, and its stored tensors by role."""
    form: str  # "fp8", "fp4" or "int"
    shape: tuple[int, int]  # [R, C], dequantized
    data: str  # the stored values' tensor
    scale: str
    block: tuple[int, int]  # rows and columns one scale covers (int: 1 and the group's width)
    bits: int = 0  # int: the values' width
    zero: str | None = None  # int, asymmetric: the packed zero points


def quantization_config(folder: str) -> dict:
    """config.json's quantization_config (a multimodal release's text model's where the top level has none)."""
    try:
        with open(os.path.join(folder, "config.json")) as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return config.get("quantization_config") or text.get("quantization_config") or {}


def headers(folder: str) -> dict[str, tuple[str, tuple[int, ...], str, int]]:
    """{tensor: (dtype, shape, file, data offset)} of every safetensors file in `folder`, from their headers."""
    out = {}
    for path in sorted(glob.glob(os.path.join(glob.escape(folder), "*.safetensors"))):
        with open(path, "rb") as fh:
            length = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(length))
        out.update({name: (e["dtype"], tuple(e["shape"]), path, 8 + length + e["data_offsets"][0])
                    for name, e in header.items() if name != "__metadata__"})
    return out


def describe(folder: str) -> dict[str, Quantized]:
    """{the weight's name as transformers saves it (`<m>.weight`): how it is stored} for the quantized weights of the
    folder; {} for a plain one. ValueError, one line naming the tensor and what it needs, for a quantized tensor whose
    scale (or shape, or a part) is missing or misshapen, a scale beside no quantized weight, quantized tensors with
    no quantization_config saying so, or a form neither Tessera nor transformers reads."""
    quant, stored = quantization_config(folder), headers(folder)
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        return _compressed(folder, quant, stored)
    if method not in (None, "fp8", "mxfp4"):
        raise ValueError(f"{os.path.join(folder, 'config.json')}: quantization_config quant_method = {method!r}; "
                         f"Tessera dequantizes fp8 (blocks), DeepSeek V4's fp4 experts, compressed-tensors' "
                         f"pack-quantized int weights and mxfp4 as it reads them, not these; pass bf16 weights")
    scales = sorted(n for n in stored if n.endswith(_SCALES) and (method == "fp8" or n.endswith(_SCALES[0])))
    if method != "fp8":
        if scales or (fp8 := sorted(n for n, (dtype, *_) in stored.items() if dtype in FP8_DTYPES)):
            raise ValueError(f"'{folder}' holds FP8 block-quantized weights ('{(scales or fp8)[0]}') but its "
                             f"config.json has no fp8 quantization_config with weight_block_size; add it or pass "
                             f"dequantized weights")
        return {}
    block = quant.get("weight_block_size") or [128, 128]
    if len(block) != 2 or min(block) <= 0:
        raise ValueError(f"{os.path.join(folder, 'config.json')}: weight_block_size = {block}; two positive "
                         f"integers (rows, columns) are required")
    out = {}
    for name in scales:
        weight = name.removesuffix(next(s for s in _SCALES if name.endswith(s))) + ".weight"
        if weight not in stored or stored[weight][0] not in (*FP8_DTYPES, "I8", "U8"):
            raise ValueError(f"scale '{name}' in '{folder}' has no FP8 or FP4 weight beside it"
                             + (f" ('{weight}' is {stored[weight][0]})" if weight in stored else ""))
        out[weight] = _block(folder, weight, name, stored, tuple(block))
    for name, (dtype, *_) in sorted(stored.items()):
        if dtype in FP8_DTYPES and name not in out:
            raise ValueError(f"missing scale for the FP8 weight '{name}' in '{folder}': "
                             f"'{name.removesuffix('.weight')}.weight_scale_inv' (or '.scale'); the folder is "
                             f"incomplete, download it again")
    return out


def _block(folder: str, weight: str, scale: str, stored: dict, block: tuple[int, int]) -> Quantized:
    dtype, shape, *_ = stored[weight]
    if len(shape) != 2:
        raise ValueError(f"quantized weight '{weight}' in '{folder}' is {list(shape)}: 2 dimensions are read")
    fp4 = dtype in ("I8", "U8")  # two e2m1 values a byte, as transformers reads an integer weight beside a scale
    rows, cols = (shape[0], 2 * shape[1]) if fp4 else shape
    block = (1, 32) if fp4 else block
    want = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if stored[scale][1] != want:
        kind = "FP4 weight, one scale per 32 values of a row," if fp4 else f"FP8 weight in blocks of {list(block)}"
        raise ValueError(f"scale '{scale}' in '{folder}' is {list(stored[scale][1])}, but the {kind} '{weight}' "
                         f"[{rows}, {cols}] needs {list(want)}; the folder is damaged or not this model's")
    return Quantized("fp4" if fp4 else "fp8", (rows, cols), weight, scale, block)


def _compressed(folder: str, quant: dict, stored: dict) -> dict[str, Quantized]:
    """compressed-tensors' pack-quantized int weights (its other formats are refused)."""
    groups = [g for g in (quant.get("config_groups") or {}).values() if isinstance(g, dict)]
    formats = {g.get("format") or quant.get("format") for g in groups} or {quant.get("format")}
    kinds = {(g.get("weights") or {}).get("type", "int") for g in groups}
    if formats != {"pack-quantized"} or kinds - {"int"}:
        what = ", ".join(sorted(map(str, formats))) + (f" ({', '.join(sorted(kinds))} weights)" if kinds else "")
        raise ValueError(f"{os.path.join(folder, 'config.json')}: quantization_config format {what} of "
                         f"compressed-tensors; Tessera dequantizes its pack-quantized int weights (Kimi K2.5's INT4) "
                         f"as it reads them, not these; pass bf16 weights")
    widths = sorted({int((g.get("weights") or {}).get("num_bits", 4)) for g in groups}) or [4]
    out = {}
    for packed in sorted(n for n in stored if n.endswith(".weight_packed")):
        base = packed.removesuffix("weight_packed")
        for part in ("weight_scale", "weight_shape"):
            if base + part not in stored:
                raise ValueError(f"missing '{base}{part}' beside the packed weight '{packed}' in '{folder}'; the "
                                 f"folder is incomplete, download it again")
        shape = stored[base + "weight_shape"]
        if shape[1] != (2,) or shape[0] not in ("I64", "I32"):
            raise ValueError(f"'{base}weight_shape' in '{folder}' is {shape[0]} {list(shape[1])}: 2 integers (rows, "
                             f"columns) are read")
        rows, cols = _read_ints(shape[2], shape[3], shape[0])
        scale, words = stored[base + "weight_scale"][1], stored[packed][1]
        bits = [b for b in widths if words == (rows, math.ceil(cols * b / 32))]
        groups = scale[1] if len(scale) == 2 and scale[0] == rows else 0
        if not bits or not groups or cols % groups:
            why = f"'{packed}' is {list(words)}" if not bits else f"'{base}weight_scale' is {list(scale)}"
            raise ValueError(f"{why} in '{folder}', which does not fit a packed [{rows}, {cols}] weight of "
                             f"{'/'.join(map(str, widths))}-bit values with one scale per group of a row")
        zero = base + "weight_zero_point" if base + "weight_zero_point" in stored else None
        if zero and stored[zero][1] != (math.ceil(rows * bits[0] / 32), groups):
            raise ValueError(f"'{zero}' in '{folder}' is {list(stored[zero][1])}, but [{rows}, {groups}] zero points "
                             f"packed down the rows need {[math.ceil(rows * bits[0] / 32), groups]}")
        out[base + "weight"] = Quantized("int", (rows, cols), packed, base + "weight_scale", (1, cols // groups),
                                         bits[0], zero)
    for name in stored:
        base, _, part = name.rpartition(".")
        if part in _INT[1:] and base + ".weight" not in out:
            raise ValueError(f"'{name}' in '{folder}' has no packed weight ('{base}.weight_packed') beside it")
    return out


def _read_ints(path: str, offset: int, dtype: str) -> list[int]:
    """The 2 integers stored at `offset` of `path`."""
    size, code = (8, "q") if dtype == "I64" else (4, "i")
    with open(path, "rb") as fh:
        fh.seek(offset)
        return list(struct.unpack(f"<2{code}", fh.read(2 * size)))


def stored_parts(quantized: dict[str, Quantized]) -> set[str]:
    """The stored tensors the quantized weights are made of."""
    return {n for q in quantized.values() for n in (q.data, q.scale, q.zero, q.data.removesuffix("weight_packed")
                                                    + "weight_shape" if q.form == "int" else None) if n}
