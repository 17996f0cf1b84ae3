"""Quantized weights dequantized as DCP reads them (tessera.checkpoint.quantization describes the forms).

The reader shows each quantized weight as one tensor of its dequantized shape, its stored parts hidden; for each
read (a rank's rows and columns of it, DCP's plan) it reads the stored values and scales of those rows and columns
only, dequantizes them, and copies them into the model's tensor. fp8 and fp4 compute in fp32, exactly (an fp8 or
e2m1 value times a power of two, or times an fp32 scale, as transformers does); int computes in the scale's dtype,
as compressed-tensors does, so the weights are transformers' bit for bit."""

import torch
from safetensors import safe_open
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint._hf_utils import _HFStorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from tessera.checkpoint.mxfp4 import FP4
from tessera.checkpoint.quantization import Quantized, headers, stored_parts

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}  # the rest (float8, e8m0) only as what they dequantize to, fp32


class DequantizingReader(HuggingFaceStorageReader):
    """DCP's Hugging Face reader of `path`, with the quantized weights `quantized` (quantization.describe's)
    dequantized as they are read."""

    def __init__(self, path: str, quantized: dict[str, Quantized]):
        super().__init__(path)
        self.quantized = quantized
        self.files: dict[str, str] = {}  # stored tensor -> its file

    def read_metadata(self) -> Metadata:
        """From the files' headers (DCP's own reader knows no e8m0 scales): every stored tensor but the quantized
        weights' parts, each quantized weight as one fp32 tensor of its dequantized shape."""
        tensors, storage = {}, {}
        stored = headers(str(self.path))
        self.files = {name: path for name, (_, _, path, _) in stored.items()}
        shown = {n: (_DTYPES.get(dtype, torch.float32), shape, path) for n, (dtype, shape, path, _) in stored.items()
                 if n not in stored_parts(self.quantized)}
        shown.update({n: (torch.float32, q.shape, self.files[q.data]) for n, q in self.quantized.items()})
        for name, (kind, shape, path) in shown.items():
            size = torch.Size(shape)
            tensors[name] = TensorStorageMetadata(properties=TensorProperties(dtype=kind), size=size,
                                                  chunks=[ChunkStorageMetadata(torch.Size([0] * len(size)), size)])
            storage[MetadataIndex(name, [0] * len(size))] = _HFStorageInfo(path, size, kind)
        metadata = Metadata(state_dict_metadata=tensors, storage_data=storage, storage_meta=StorageMeta())
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _process_read_request(self, f, req, planner) -> None:
        q = self.quantized.get(req.storage_index.fqn)
        if q is None:
            return super()._process_read_request(f, req, planner)
        rows, cols = (slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths, strict=True))
        read = lambda name, *where: self._read(f, q.data, name, where)  # noqa: E731
        if q.form == "int":
            value = dequantize_int(q, read(q.data, rows), read(q.scale, rows), read(q.zero) if q.zero else None,
                                   rows)[:, cols]
        else:
            blocks = slice(rows.start // q.block[0], (rows.stop - 1) // q.block[0] + 1), \
                slice(cols.start // q.block[1], (cols.stop - 1) // q.block[1] + 1)
            scale = spread(read(q.scale, *blocks), q.block, rows, cols)
            if q.form == "fp4":  # the bytes holding the columns asked, two values each
                first = cols.start - cols.start % 2
                values = fp4_values(read(q.data, rows, slice(first // 2, (cols.stop + 1) // 2)))
                value = values[:, cols.start - first:cols.stop - first] * scale
            else:
                value = read(q.data, rows, cols).float() * scale
        target = planner.resolve_tensor(req).detach()
        target.copy_(value)
        planner.commit_tensor(req, target)

    def _read(self, f, data: str, name: str, where: tuple) -> torch.Tensor:
        """Stored tensor `name`'s slice `where` (all of it when empty): from `f`, the open file of the weight's values,
        or from its own file."""
        if self.files[name] == self.files[data]:
            return f.get_slice(name)[where] if where else f.get_tensor(name)
        with safe_open(self.files[name], framework="pt") as other:
            return other.get_slice(name)[where] if where else other.get_tensor(name)


def spread(scale: torch.Tensor, block: tuple[int, int], rows: slice, cols: slice) -> torch.Tensor:
    """The scales of the blocks that rows x cols overlap (from the block holding their first row and column), one per
    element of rows x cols (fp32)."""
    full = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    top, left = rows.start % block[0], cols.start % block[1]
    return full[top:top + rows.stop - rows.start, left:left + cols.stop - cols.start]


def fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes of two e2m1 values each (low nibble first) -> [..., 2 n] fp32."""
    lut = torch.tensor(FP4, dtype=torch.float32, device=packed.device)
    raw = packed.view(torch.uint8).long()
    return torch.stack([lut[raw & 0x0F], lut[raw >> 4]], dim=-1).flatten(-2)


def unpack_ints(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """[R, W] int32 words -> the first `count` `bits`-wide values of each row (element i at bit i x bits of the row,
    low bits first, a value spanning two words continuing in the next), less the offset 2^(bits - 1), as int32."""
    if bits == 4:  # two values a byte: bytes in memory order (little-endian words) are the values' order
        raw = words.contiguous().view(torch.uint8)
        values = torch.stack([raw & 0x0F, raw >> 4], dim=-1).flatten(-2)[:, :count].int()
    else:
        wide = words.long() & 0xFFFFFFFF
        at = torch.arange(count, device=words.device) * bits
        word, shift = at // 32, at % 32
        low = wide[:, word] >> shift
        high = torch.where(shift + bits > 32, wide[:, (word + 1).clamp(max=words.shape[1] - 1)] << (32 - shift), 0)
        values = ((low | high) & ((1 << bits) - 1)).int()
    return values - (1 << (bits - 1))


def dequantize_int(q: Quantized, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                   rows: slice) -> torch.Tensor:
    """Rows `rows` of a pack-quantized weight from their packed words and scales (and the whole packed zero points):
    (value - zero) x scale per group, in the scale's dtype."""
    values = unpack_ints(packed, q.bits, q.shape[1]).to(scale.dtype).unflatten(-1, (scale.shape[-1], -1))
    if zero is not None:  # packed down the rows: unpacked as the rows of its transpose
        zeros = unpack_ints(zero.t(), q.bits, q.shape[0]).t()[rows]
        values = values - zeros.to(scale.dtype).unsqueeze(-1)
    return (values * scale.unsqueeze(-1)).flatten(-2)
