"""Releases as their labs publish them, each a tiny model written in the release's names, dtypes and packing, which
transformers itself loads (dequantizing on CPU): DeepSeek V4's (FP8 blocks with e8m0 scales named `.scale`, FP4
routed experts, `attn.kv_norm`, its MTP depth `mtp.0.*` and the depth's copies of embedding and head), Kimi K2.5's
(INT4 experts, compressed-tensors' pack-quantized groups, bf16 scales) and GLM-5's (FP8 blocks with fp32 inverse
scales, the indexer's among them, its MTP layer as layer L). Each imports to transformers' logits and greedy ids on
the same folder, its dequantized weights equal to transformers' bit for bit; exports are the training dtype under
the release's names. A folder whose scales are missing or misshapen is refused in one line naming the tensor,
before ranks start and on import."""

import json
import re

import pytest
import torch

from tessera.checkpoint.hf import HFError, load_hf, save_hf
from tessera.generate import from_pretrained, generate
from tessera.models import family
from tests.hf_parity import import_hf, initialized

V4 = family("deepseek_v4")
S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def fp8_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 e4m3 values, e8m0 scales): w in blocks of block x block, each scaled by a power of two."""
    rows, cols = w.shape
    tiles = w.view(rows // block, block, cols // block, block)
    scale = torch.exp2(torch.ceil(torch.log2(tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0)))
    return (tiles / scale[:, None, :, None]).view(rows, cols).to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def fp4_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 bytes of two e2m1 values each, low nibble first; e8m0 scales, one per 32 values of a row)."""
    rows, cols = w.shape
    groups = w.view(rows, cols // 32, 32)
    scale = torch.exp2(torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-12) / 6.0)))
    x = groups / scale[..., None]
    code = ((x.abs()[..., None] - E2M1).abs().argmin(-1) + 8 * (x < 0)).view(rows, cols).to(torch.uint8)
    return (code[:, 0::2] | (code[:, 1::2] << 4)).view(torch.int8), scale.to(torch.float8_e8m0fnu)


def _write(folder, state: dict, config: dict) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(state,
                                                                                             "model.safetensors")}))
    (folder / "config.json").write_text(json.dumps(config))


_FP8 = ("attn.wq_a.", "attn.wq_b.", "attn.wkv.", "attn.wo_a.", "attn.wo_b.", "shared_experts.", "indexer.wq_b.",
        "e_proj.", "h_proj.")  # the release's FP8 weights; routed experts FP4; the rest (compressors, router...) bf16


def v4_release(tmp_path, block: int = 4):
    """transformers' V4 (sliding, CSA and HCA blocks, a hash-routed one) saved, rewritten as DeepSeek released V4:
    its names, a random MTP depth (a CSA block) beside them with the copies of embedding and head, FP8 / FP4 forms
    and quantization_config. (transformers' model, the folder, {name: the dequantized weight})."""
    from safetensors.torch import load_file

    from tests.test_deepseek_v4 import _theirs

    theirs = _theirs(tmp_path / "saved", layer_types=[S, C, H], mlp_layer_types=["hash_moe", "moe", "moe"],
                     compress_rates={C: 4, H: 8}, sliding_window=6, hc_mult=2, index_topk=3, moe_intermediate_size=32)
    config = json.loads((tmp_path / "saved/config.json").read_text())
    # the depth's block listed after the trunk's (as the release's compress_ratios does, whose rates transformers
    # maps from the release's 4 and 128 only)
    config.update(layer_types=[S, C, H, C], num_nextn_predict_layers=1, expert_dtype="fp4", quantization_config={
                      "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                      "weight_block_size": [block, block]})
    renames = {"model.embed_tokens.weight": "embed.weight", "model.hc_head.hc_fn": "hc_head_fn",
               "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
    plain = {renames.get(k, k.removeprefix("model.")).replace("attn.norm.", "attn.kv_norm."): v
             for k, v in load_file(tmp_path / "saved/model.safetensors").items()}
    args = V4.hf.args_from_hf_config(config)
    depth = initialized(V4, args, seed=3).state_dict()
    plain.update({k: v.normal_(0, 0.3) if "norm" not in k and ".gate." not in k else v
                  for k, v in V4.hf.to_hf({n: t for n, t in depth.items() if n.startswith("mtp.")}).items()})
    stored = {"mtp.0.emb.tok_emb.weight": plain["embed.weight"].clone(),
              "mtp.0.head.weight": plain["head.weight"].clone()}
    dequantized = {}
    for name, w in plain.items():
        if not name.endswith(".weight") or w.dim() != 2 or not (".experts." in name or any(k in name for k in _FP8)):
            stored[name] = w
            continue
        routed = ".experts." in name and "shared" not in name
        values, scale = fp4_rows(w) if routed else fp8_blocks(w, block)
        stored.update({name: values, name.removesuffix("weight") + "scale": scale})
        dequantized[name] = _dequantized(values, scale, routed, block)
    _write(tmp_path / "release", stored, config)
    return theirs, tmp_path / "release", dequantized


def _dequantized(values: torch.Tensor, scale: torch.Tensor, routed: bool, block: int) -> torch.Tensor:
    """What the release's inference code multiplies: each value times its scale (fp32)."""
    if routed:
        raw = values.view(torch.uint8).long()
        lut = torch.cat([E2M1, -E2M1])
        floats = torch.stack([lut[raw & 15], lut[raw >> 4]], dim=-1).flatten(-2)
        return floats * scale.float().repeat_interleave(32, 1)
    return values.float() * scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)


def _greedy_equal(theirs, folder) -> None:
    model, _ = from_pretrained(folder)
    prompt = [3, 17, 42, 5]
    want = theirs.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert generate(model, prompt, 10) == want[0, len(prompt):].tolist()


def test_deepseek_v4_as_released_loads_to_transformers_logits_with_its_mtp_depth_and_exports_its_names(tmp_path):
    transformers = pytest.importorskip("transformers")
    _, folder, dequantized = v4_release(tmp_path)
    theirs = transformers.DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours, args = import_hf("deepseek_v4", folder)
    assert args.n_mtp == 1 and args.mtp_layer_types == [C]
    loaded = V4.hf.to_hf(ours.state_dict())
    for name in ("layers.1.attn.wq_b.weight", "layers.2.ffn.experts.3.w2.weight", "mtp.0.e_proj.weight",
                 "mtp.0.ffn.experts.1.w1.weight", "mtp.0.attn.indexer.wq_b.weight"):
        torch.testing.assert_close(loaded[name], dequantized[name], rtol=0, atol=0, msg=name)
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(tokens).logits
        torch.testing.assert_close(ours(tokens), expected, rtol=1e-5, atol=1e-5)
    _greedy_equal(theirs, folder)
    save_hf(ours, args, tmp_path / "out", dtype=torch.bfloat16)
    from safetensors import safe_open

    with safe_open(tmp_path / "out/model-00001-of-00001.safetensors", "pt") as fh:
        exported = {n: fh.get_slice(n).get_dtype() for n in fh.keys()}
    released = set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])
    assert set(exported) | set(_integers(tmp_path / "out")) == {
        n for n in released if not n.endswith(".scale") and not re.fullmatch(r"mtp\.0\.(emb\.tok_emb|head)\.weight", n)}
    assert set(exported.values()) == {"BF16"}
    back, _ = import_hf("deepseek_v4", tmp_path / "out")  # the depth round-trips exactly (in the export's dtype)
    for name, value in back.state_dict().items():
        if name.startswith("mtp."):
            torch.testing.assert_close(value, ours.state_dict()[name].bfloat16().float(), rtol=0, atol=0, msg=name)


def _integers(folder) -> list[str]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    return [n for n, f in index.items() if "integers" in f]


def test_kimi_k25_int4_experts_dequantize_as_compressed_tensors_does(tmp_path):
    """K2.5's experts as INT4 groups of 16 (pack-quantized, bf16 scales), the rest bf16 as released: our weights equal
    transformers' bit for bit (dequantized in the scale's dtype), so do logits (their experts, bf16, computed in fp32
    here as ours are) and greedy ids."""
    transformers = pytest.importorskip("transformers")
    pack = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers").pack_to_int32
    from safetensors.torch import load_file

    from tests.test_kimi_k2 import _kimi

    _kimi(tmp_path / "saved", tie_word_embeddings=False)
    stored = {}
    for name, w in load_file(tmp_path / "saved/model.safetensors").items():
        name = name.replace("language_model.model.blocks.", "language_model.model.layers.")
        if ".mlp.experts." not in name:
            stored[name] = w.bfloat16()
            continue
        groups = w.view(w.shape[0], -1, 16)
        scale = (groups.abs().amax(-1) / 7).bfloat16()
        q = torch.round(groups / scale.float()[..., None]).clamp(-8, 7).to(torch.int8).view(w.shape)
        base = name.removesuffix("weight")
        stored.update({base + "weight_packed": pack(q, 4), base + "weight_scale": scale,
                       base + "weight_shape": torch.tensor(list(w.shape))})
    config = json.loads((tmp_path / "saved/config.json").read_text())
    config["text_config"]["model_type"] = "kimi_k2"
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": [r"re:.*mlp\.experts.*"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16,
            "dynamic": False}}}}
    _write(tmp_path / "release", stored, config)
    theirs = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(tmp_path / "release").eval()
    ours, _ = import_hf("deepseek_v3", tmp_path / "release")
    experts = theirs.model.language_model.layers[1].mlp.experts
    assert experts.gate_up_proj.dtype == torch.bfloat16
    gate, up = experts.gate_up_proj.chunk(2, dim=1)
    for got, want in ((ours.layers["1"].feed_forward.experts.w1, gate), (ours.layers["1"].feed_forward.experts.w3, up),
                      (ours.layers["1"].feed_forward.experts.w2, experts.down_proj)):
        torch.testing.assert_close(got, want.float(), rtol=0, atol=0)
    torch.nn.Module.float(theirs)  # transformers' own float() refuses a quantized model; its values are bf16's
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
    _greedy_equal(theirs, tmp_path / "release")


@pytest.mark.fast
@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_packed_ints_dequantize_as_compressed_tensors_decompresses_them(bits, symmetric):
    """Any width (values spanning two words too), with or without zero points packed down the rows, rows read apart:
    equal to compressed-tensors' own decompression."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from tessera.checkpoint.dequantize import dequantize_int
    from tessera.checkpoint.quantization import Quantized

    rows, cols, group = 12, 40, 8
    gen = torch.Generator().manual_seed(bits)
    top = 1 << (bits - 1)
    q = torch.randint(-top, top, (rows, cols), generator=gen, dtype=torch.int8)
    scale = torch.rand(rows, cols // group, generator=gen).bfloat16()
    zero = torch.randint(-top, top, (rows, cols // group), generator=gen, dtype=torch.int8) if not symmetric else None
    state = {"weight_packed": pack_to_int32(q, bits), "weight_scale": scale, "weight_shape": torch.tensor([rows, cols])}
    if zero is not None:
        state["weight_zero_point"] = pack_to_int32(zero, bits, packed_dim=0)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=bits, type="int", symmetric=symmetric, strategy="group", group_size=group))
    want = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    spec = Quantized("int", (rows, cols), "w.weight_packed", "w.weight_scale", (1, group), bits,
                     "w.weight_zero_point" if zero is not None else None)
    for part in (slice(0, rows), slice(5, 9)):
        got = dequantize_int(spec, state["weight_packed"][part], scale[part], state.get("weight_zero_point"), part)
        assert got.dtype == want.dtype and torch.equal(got, want[part]), (part, ct.__version__)


_NOT_FP8 = ("embed_tokens", "lm_head", "shared_head.head", "mlp.gate.weight", "weights_proj")


def test_glm5_as_released_fp8_with_its_mtp_layer_loads_to_transformers_logits(tmp_path):
    """GLM-5's published layout (GlmMoeDsaForCausalLM's names, blocks sharing an indexer's selection, the MTP layer
    as layer L with eh_proj, enorm, hnorm, shared_head and its own indexer) in FP8 blocks with fp32 inverse scales
    (the indexer's wq_b and wk among them, as GLM-5-FP8 stores them): logits and greedy ids equal transformers' on
    the folder; the MTP layer loads into the depth, dequantized."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    from tests.test_deepseek_v3 import _quantize_fp8
    from tests.test_deepseek_v32 import GLM5, _theirs

    _theirs(tmp_path / "in", True, **GLM5["shared_blocks"])
    config = json.loads((tmp_path / "in/config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (tmp_path / "in/config.json").write_text(json.dumps(config))
    dsv3 = family("deepseek_v3")
    args = dsv3.hf.args_from_hf_config(config)
    depth = dsv3.hf.to_hf(initialized(dsv3, args, seed=4).state_dict())  # the depth's layer 4, random
    state = {**load_file(tmp_path / "in/model.safetensors"),
             **{k: v.clone() for k, v in depth.items() if k.startswith("model.layers.4.")}}
    state["model.layers.4.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state["model.layers.4.shared_head.head.weight"] = state["lm_head.weight"].clone()
    assert {"model.layers.4.eh_proj.weight", "model.layers.4.shared_head.norm.weight",
            "model.layers.4.self_attn.indexer.wk.weight", "model.layers.4.mlp.experts.7.down_proj.weight"} <= set(state)
    save_file(state, tmp_path / "in/model.safetensors", metadata={"format": "pt"})
    _quantize_fp8(tmp_path / "in", 8, lambda name, w: w.dim() == 2 and name.endswith(".weight") and
                  "norm" not in name and not any(k in name for k in _NOT_FP8))
    stored = load_file(tmp_path / "in/model.safetensors")
    assert stored["model.layers.4.self_attn.indexer.wk.weight"].dtype == torch.float8_e4m3fn
    theirs = transformers.GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "in", dtype=torch.float32).eval()
    ours, args = import_hf("deepseek_v3", tmp_path / "in")
    assert args.n_mtp == 1 and args.index_shared == [1, 3]
    weight, scale = stored["model.layers.4.eh_proj.weight"], stored["model.layers.4.eh_proj.weight_scale_inv"]
    torch.testing.assert_close(ours.mtp["0"].eh_proj.weight, weight.float() * scale.repeat_interleave(8, 0)
                               .repeat_interleave(8, 1), rtol=0, atol=0)
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
    _greedy_equal(theirs, tmp_path / "in")


@pytest.mark.parametrize(("change", "line"), [
    (lambda s: s.pop("layers.1.attn.wq_b.scale"),
     "missing scale for the FP8 weight 'layers.1.attn.wq_b.weight' in '{folder}': 'layers.1.attn.wq_b.weight_scale_inv'"
     " (or '.scale'); the folder is incomplete, download it again"),
    (lambda s: s.update({"layers.2.ffn.experts.0.w1.scale": s["layers.2.ffn.experts.0.w1.scale"][:, :0]}),
     "scale 'layers.2.ffn.experts.0.w1.scale' in '{folder}' is [32, 0], but the FP4 weight, one scale per 32 values "
     "of a row, 'layers.2.ffn.experts.0.w1.weight' [32, 32] needs [32, 1]; the folder is damaged or not this model's"),
])
def test_missing_or_misshapen_scales_are_refused_in_one_line_before_ranks_start(tmp_path, capsys, change, line):
    from safetensors.torch import load_file, save_file

    from tessera import config_cli

    _, folder, _ = v4_release(tmp_path)
    state = load_file(folder / "model.safetensors")
    change(state)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    line = line.format(folder=folder)
    capsys.readouterr()
    assert config_cli.main(["--model.name", "deepseek_v4", "--model.flavor=", "--checkpoint.enable",
                            "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(folder),
                            "--job.dump_folder", str(tmp_path / "run")]) != 0
    assert capsys.readouterr().err.strip().splitlines() == [f"tessera: checkpoint.initial_load_path: {line}"]
    with torch.device("meta"):
        model = V4.spec().model(V4.hf.args_from_hf_config(json.loads((folder / "config.json").read_text())))
    with pytest.raises(HFError, match="^" + re.escape(line) + "$"):
        load_hf(model, folder)
