"""DeepSeek V3: counts against the published ones, MLA + DeepSeek MoE logits, both HF directions and greedy
generation against transformers for tiny random configs (with and without the query bottleneck, interleaved
RoPE, YaRN), multi-token prediction against transformers' MtpModel and its loss, FP8 block-quantized
checkpoints dequantized on import, and FSDP/EP/PP/CP/TP layouts (8 ranks at most) equal to one process."""

import dataclasses
import json
import re

import pytest
import torch

from tessera.checkpoint.hf import load_hf, save_hf
from tessera.models import family, hf_args, num_params
from tests.hf_parity import assert_round_trip

DSV3 = family("deepseek_v3")


@pytest.mark.parametrize("flavor, total, active", [("16B", 15.7, 2.4), ("236B", 236, 21), ("671B", 671, 37)])
def test_parameter_counts_match_the_published_ones(flavor, total, active):
    """The main model's (the published counts leave out V3's MTP depth); with it, the 671B checkpoint holds
    685B, as published (its MTP layer keeps copies of the embedding and the head)."""
    args = DSV3.flavors[flavor]
    counts = DSV3.counts(dataclasses.replace(args, n_mtp=0), 4096)
    active_b = (counts.active - counts.embedding) / 1e9  # published: without the input embedding
    assert abs(counts.params / 1e9 - total) / total < 0.02 and abs(active_b - active) / active < 0.03
    if args.n_mtp:
        stored = DSV3.counts(args, 4096).params + 2 * args.vocab_size * args.dim
        assert abs(stored / 1e9 - 685) / 685 < 0.02
    for args in (DSV3.flavors["debugmodel"], DSV3.flavors["debugmodel_v2"], DSV3.flavors["debugmodel_mtp"]):
        with torch.device("meta"):
            model = DSV3.spec().model(dataclasses.replace(args, vocab_size=258))
        assert DSV3.counts(model.args, 32).params == num_params(model)


_CONFIGS = {  # not presets: a query bottleneck or not, pairs or halves RoPE, YaRN with its softmax scale
    "q_lora_interleaved_yarn": dict(q_lora_rank=24, rope_interleave=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "plain_q_halves": dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1),
}


def _theirs(path, vocab_size: int = 97, **overrides):
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(**{
        "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
        "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1, "vocab_size": vocab_size, "max_position_embeddings": 64, "num_mtp_layers": 0,
        "bos_token_id": None, "eos_token_id": None, **overrides})
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # HF starts the router and its bias at 0 and norms at 1: make them count
        for name, p in model.named_parameters():
            if "mlp.gate" in name or "experts" in name:
                p.normal_(0, 0.3)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    model.save_pretrained(path)
    return model


def _ours(path, seq: int = 32):
    args = dataclasses.replace(hf_args("deepseek_v3", str(path)), max_seq_len=seq)
    with torch.device("meta"):
        model = DSV3.spec().model(args)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    load_hf(model.eval(), path)
    return model, args


@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_logits_import_export_and_greedy_generation_equal_transformers(tmp_path, name):
    transformers = pytest.importorskip("transformers")
    theirs = _theirs(tmp_path / "in", **_CONFIGS[name])
    ours, args = _ours(tmp_path / "in")
    assert_round_trip(theirs, ours, args, transformers.DeepseekV3ForCausalLM, tmp_path / "in", tmp_path)


def test_a_folder_transformers_saved_loads_without_the_mtp_depth_its_config_declares(tmp_path, capsys, caplog):
    """transformers' DeepseekV3Config declares 1 MTP depth (num_nextn_predict_layers) that save_pretrained never
    writes: such a folder loads without it, saying so in one line, and python -m tessera.generate's greedy
    continuation equals transformers'; the round trip holds (the export declares 0 depths)."""
    from transformers import DeepseekV3ForCausalLM

    from tessera.generate import main

    theirs = _theirs(tmp_path / "in", num_mtp_layers=1, **_CONFIGS["plain_q_halves"])
    assert json.loads((tmp_path / "in" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    ours, args = _ours(tmp_path / "in")
    assert args.n_mtp == 0 and ours.mtp is None
    assert [r.getMessage() for r in caplog.records if r.name == "tessera"] == [
        f"{tmp_path / 'in'}: config.json declares 1 MTP depth(s) (num_nextn_predict_layers) but the folder holds none "
        f"of their weights (model.layers.3...; transformers saves none): loaded without them"]
    prompt = [3, 17, 42, 5]
    argv = ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(tmp_path / "in"),
            "--generate.prompt_ids", ",".join(map(str, prompt)), "--generate.max_new_tokens", "12",
            "--generate.temperature", "0", "--generate.json"]
    capsys.readouterr()
    assert main(argv) == 0
    want = theirs.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert json.loads(capsys.readouterr().out)["output_ids"] == want[0, len(prompt):].tolist()
    assert_round_trip(theirs, ours, args, DeepseekV3ForCausalLM, tmp_path / "in", tmp_path)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_a_run_training_mtp_starts_the_missing_depth_fresh_and_a_partial_depth_is_refused(tmp_path, caplog):
    """A run with training.mtp_loss_weight > 0 builds the declared depth from such a folder and keeps it as
    initialized (the rest loaded); at weight 0 it builds none. A folder holding part of an MTP layer is refused,
    naming the missing tensor and the parameter it is for."""
    from safetensors.torch import load_file, save_file

    from tessera import architecture
    from tessera.checkpoint.hf import HFError
    from tessera.parallel.init import materialize
    from tessera.schema import parse_args

    theirs = _theirs(tmp_path / "in", num_mtp_layers=1, **_CONFIGS["plain_q_halves"])
    run = ["--model.name", "deepseek_v3", "--model.flavor=", "--checkpoint.initial_load_in_hf",
           "--checkpoint.initial_load_path", str(tmp_path / "in"), "--training.seq_len", "32"]

    def resolve(argv):
        return architecture.resolve(architecture.request(DSV3, parse_args(argv)), None, None)

    assert resolve([*run, "--training.mtp_loss_weight", "0"]).n_mtp == 0
    args = resolve(run)
    assert args.n_mtp == 1
    with torch.device("meta"):
        model = DSV3.spec().model(args)
    materialize(model, torch.device("cpu"), 0)
    initialized = {n: p.clone() for n, p in model.state_dict().items() if n.startswith("mtp.")}
    load_hf(model, tmp_path / "in")
    assert [r for r in caplog.records if r.name == "tessera"][-1].getMessage().endswith("start freshly initialized")
    for name, value in initialized.items():
        assert torch.equal(model.state_dict()[name], value), name
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
    _add_mtp(tmp_path / "in", theirs, 1)
    state = load_file(tmp_path / "in" / "model.safetensors")
    del state["model.layers.3.enorm.weight"]
    save_file(state, tmp_path / "in" / "model.safetensors", metadata={"format": "pt"})
    assert hf_args("deepseek_v3", str(tmp_path / "in")).n_mtp == 1
    with pytest.raises(HFError, match=r"^missing tensor 'model.layers.3.enorm.weight' \(for mtp.0.enorm.weight\) "):
        _ours(tmp_path / "in")


def _add_mtp(folder, theirs, depths: int):
    """transformers' MtpModel over `theirs`, random, its weights added to the folder as DeepSeek lays them
    out: layers L, L + 1... (per-expert tensors, `shared_head.norm`, copies of the embedding and head)."""
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel

    theirs.config.num_mtp_layers = depths
    torch.manual_seed(2)
    mtp = MtpModel(theirs, depths).eval()
    state, n = load_file(folder / "model.safetensors"), theirs.config.num_hidden_layers
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if "mlp.gate" in name or "experts" in name:
                p.normal_(0, 0.3)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
        for layer in mtp.layers:
            layer.mtp_block.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    for name, value in mtp.state_dict().items():
        if not (m := re.fullmatch(r"layers\.(\d+)\.(?:mtp_block\.)?(.+)", name)):
            continue  # the embedding and head: the main model's
        prefix, rest = f"model.layers.{n + int(m[1])}.", m[2].replace("post_norm.", "shared_head.norm.")
        if rest.endswith("experts.gate_up_proj"):  # transformers fuses what checkpoints keep per expert
            for e, w in enumerate(value):
                gate, up = w.chunk(2)
                state.update({f"{prefix}mlp.experts.{e}.gate_proj.weight": gate,
                              f"{prefix}mlp.experts.{e}.up_proj.weight": up})
        elif rest.endswith("experts.down_proj"):
            state.update({f"{prefix}mlp.experts.{e}.down_proj.weight": w for e, w in enumerate(value)})
        else:
            state[prefix + rest] = value
    for k in range(depths):
        state[f"model.layers.{n + k}.embed_tokens.weight"] = state["model.embed_tokens.weight"]
        state[f"model.layers.{n + k}.shared_head.head.weight"] = state["lm_head.weight"]
    save_file({k: v.contiguous().clone() for k, v in state.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.pop("num_mtp_layers", None)
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": depths}))
    return mtp


def _their_mtp_logits(theirs, mtp, tokens) -> list[torch.Tensor]:
    """Depth k: the previous depth's output (the model's normed last hidden states first) at positions
    0..S-k-1 with the tokens k..S-1, as transformers' MTP drafting aligns them."""
    h, out = theirs(tokens, output_hidden_states=True).hidden_states[-1], []
    for k in range(1, len(mtp.layers) + 1):
        positions = torch.arange(k, tokens.shape[1])[None]
        h = mtp.forward_layer(k - 1, h[:, :-1], positions, None, input_ids=tokens[:, k:])
        out.append(mtp._project_to_logits(h))
    return out


def test_mtp_depths_equal_transformers_and_export_as_deepseek_lays_them_out(tmp_path):
    """2 MTP depths: each depth's logits equal transformers' MtpModel within 1e-5 after import, and again after
    export (layers L, L+1 with their copies of the embedding and head), with the main logits unchanged."""
    theirs = _theirs(tmp_path / "in", **_CONFIGS["q_lora_interleaved_yarn"])
    mtp = _add_mtp(tmp_path / "in", theirs, 2)
    ours, args = _ours(tmp_path / "in")
    assert args.n_mtp == 2
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = _their_mtp_logits(theirs, mtp, tokens)
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
        got = ours.mtp_logits(ours.norm(ours.hidden(tokens)), tokens)
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        save_hf(ours, args, tmp_path / "out")
        back, _ = _ours(tmp_path / "out")
        for a, b in zip(back.mtp_logits(back.norm(back.hidden(tokens)), tokens), expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    from safetensors import safe_open

    names = set().union(*(safe_open(f, "pt").keys() for f in (tmp_path / "out").glob("*.safetensors")))
    assert {"model.layers.4.embed_tokens.weight", "model.layers.4.shared_head.head.weight",
            "model.layers.4.shared_head.norm.weight", "model.layers.4.mlp.experts.7.up_proj.weight"} <= names


def test_the_mtp_loss_adds_its_weighted_mean_over_depths_to_the_gradient():
    """Training with MTP: the logits are the main model's, and the gradients equal those of CE + w x the mean
    over depths of each depth's CE on the tokens k+1 on (computed by hand from mtp_logits), within 1e-6."""
    from tessera.parallel.init import materialize

    args = dataclasses.replace(DSV3.flavors["debugmodel_mtp"], vocab_size=64, max_seq_len=16)
    with torch.device("meta"):
        model = DSV3.spec().model(args)
    materialize(model, torch.device("cpu"), 0)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(3))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def ce(logits, targets):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    model.mtp_loss.weight = 0.3
    ce(model(inputs), labels).backward()
    assert model.mtp_loss.count == 1
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    h = model.norm(model.hidden(inputs))
    depths = [ce(out[:, :-1], inputs[:, k + 1:]) for k, out in enumerate(model.mtp_logits(h, inputs), 1)]
    (ce(model.head(h), labels) + 0.3 * torch.stack(depths).mean()).backward()
    torch.testing.assert_close(model.mtp_loss.total, torch.stack(depths).mean().detach())
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-6, atol=1e-6, msg=name)
    assert got["mtp.1.eh_proj.weight"].abs().sum() > 0


@pytest.mark.fast
def test_the_mtp_loss_leaves_out_the_targets_the_labels_mask():
    """Given labels with IGNORE (an SFT prompt, a document start), depth k trains on token i+k+1 only where label
    i+k is trained, each depth the mean over its trained targets: equal to that computed from mtp_logits with the
    masked positions left out, and not to the mean over every target. Unmasked labels give the tokens' loss."""
    from tessera.parallel.init import materialize

    args = dataclasses.replace(DSV3.flavors["debugmodel_mtp"], vocab_size=64, max_seq_len=16)
    with torch.device("meta"):
        model = DSV3.spec().model(args)
    materialize(model, torch.device("cpu"), 0)
    model.mtp_loss.weight = 1.0
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(5))
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    model(inputs, labels=labels)
    unmasked = model.mtp_loss.total
    labels[0, :6] = -100  # a prompt
    labels[1, 9] = -100  # the last token of a document: label 9 is the next one's first
    model.mtp_loss.reset()
    model(inputs, labels=labels)
    with torch.no_grad():
        h = model.norm(model.hidden(inputs))
        expected, everywhere = [], []
        for k, logits in enumerate(model.mtp_logits(h, inputs), 1):
            logits, targets, kept = logits[:, :-1], inputs[:, k + 1:], labels[:, k:-1] != -100
            expected.append(torch.nn.functional.cross_entropy(logits[kept], targets[kept]))
            everywhere.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    torch.testing.assert_close(model.mtp_loss.total, torch.stack(expected).mean(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(unmasked, torch.stack(everywhere).mean(), rtol=1e-6, atol=1e-6)
    assert (model.mtp_loss.total - unmasked).abs() > 1e-3


def _projection(name: str, w: torch.Tensor) -> bool:
    return w.dim() == 2 and "proj" in name and "norm" not in name


def _quantize_fp8(folder, block: int, quantized=_projection) -> None:
    """Rewrite an HF folder's 2-D projection weights (those `quantized(name, tensor)`) as float8_e4m3fn blocks with
    inverse scales, the way DeepSeek V3's released checkpoints are stored (quantization_config fp8,
    weight_block_size)."""
    from safetensors.torch import load_file, save_file

    index = json.loads((folder / "model.safetensors.index.json").read_text()) \
        if (folder / "model.safetensors.index.json").exists() else None
    files = sorted(folder.glob("*.safetensors"))
    weight_map = {}
    for file in files:
        state, out = load_file(file), {}
        for name, w in state.items():
            out[name] = w
            if quantized(name, w):
                rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
                padded = torch.zeros(rows * block, cols * block)
                padded[:w.shape[0], :w.shape[1]] = w
                tiles = padded.view(rows, block, cols, block)
                scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
                q = (tiles / scale[:, None, :, None]).view_as(padded)[:w.shape[0], :w.shape[1]]
                out[name] = q.to(torch.float8_e4m3fn)
                out[name.removesuffix(".weight") + ".weight_scale_inv"] = scale.float()
        save_file(out, file, metadata={"format": "pt"})
        weight_map.update({n: file.name for n in out})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (folder / "config.json").write_text(json.dumps(config))
    del index


@pytest.mark.parametrize("block", [16, 128])
def test_fp8_block_quantized_checkpoints_are_dequantized_on_import(tmp_path, block):
    """Each weight equals its fp8 blocks times their inverse scales (blocks that overhang the edges included),
    so the logits equal transformers' given the same dequantized weights."""
    from safetensors.torch import load_file
    from transformers import DeepseekV3ForCausalLM

    _theirs(tmp_path / "in", **_CONFIGS["q_lora_interleaved_yarn"])
    _quantize_fp8(tmp_path / "in", block)
    ours, _ = _ours(tmp_path / "in")
    weight_map = dequantized_copy(tmp_path / "in", tmp_path / "ref", block)
    torch.testing.assert_close(ours.state_dict()["layers.1.attention.wkv_b.weight"],
                               load_file(tmp_path / "ref" / weight_map[_KV_B])[_KV_B], rtol=0, atol=0)
    ref = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "ref").eval()
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), ref(tokens).logits, rtol=1e-5, atol=1e-5)


def dequantized_copy(folder, out, block: int) -> dict:
    """An fp8 folder (`_quantize_fp8`'s) with each weight dequantized, written to `out`; its weight map."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    weight_map = {}
    for file in folder.glob("*.safetensors"):
        state, plain = load_file(file), {}
        for name, w in state.items():
            scale = state.get(name.removesuffix(".weight") + ".weight_scale_inv")
            if name.endswith(".weight_scale_inv") or not name.endswith(".weight"):
                plain.update({} if name.endswith(".weight_scale_inv") else {name: w})
                continue
            if scale is not None:
                w = w.float() * scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:w.shape[0], :w.shape[1]]
            plain[name] = w
        save_file(plain, out / file.name, metadata={"format": "pt"})
        weight_map.update({n: file.name for n in plain})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return weight_map


_KV_B = "model.layers.1.self_attn.kv_b_proj.weight"


_FLOAT8 = ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate"]


def _packed(tmp_path, model: list) -> list:
    """`model` on short packed documents, block-causal."""
    docs = tmp_path / "short.jsonl"
    docs.write_text("".join(json.dumps({"text": f"doc {k}: " + "ab cd " * (k % 5)}) + "\n" for k in range(400)))
    return [*model, "--training.dataset", "files", "--training.dataset_path", str(docs), "--model.attn_mask_type",
            "block_causal"]


def _later_family_cases(tmp_path, batch: str, ep: list, pp: list, tp: list, cp: list, op_ac: list, v32: list,
                       glm5: list) -> dict:
    """Kimi Linear's and DeepSeek V4's layouts, and DSA's and V4's under context parallel, in the launch below:
    name -> (model and data, layout)."""
    kimi = ["--model.name", "kimi_linear", "--model.flavor", "debugmodel", "--moe.load_balance_rate", "1e-2",
            "--kimi_linear.chunk_size", "8"]
    v4 = ["--model.name", "deepseek_v4", "--model.flavor", "debugmodel", "--moe.load_balance_rate", "1e-2"]
    v4_mtp = [*v4[:3], "debugmodel_mtp", *v4[4:]]
    ulysses = [*cp, "--parallelism.context_parallel_method", "ulysses"]
    return {"Kimi Linear EP 2 x FSDP 4, op AC": (kimi, [batch, "2", *ep, *op_ac]),
            "Kimi Linear PP 2 x EP 2 x FSDP": (kimi, [batch, "4", *ep, *pp]),
            "Kimi Linear TP 2 x EP 2 x FSDP 2": (kimi, [batch, "4", *ep, *tp]),
            "Kimi Linear state passing CP 2 x TP 2, documents": (_packed(tmp_path, kimi), [batch, "8", *cp, *tp]),
            "Kimi Linear Ulysses CP 2 x EP 2, documents": (_packed(tmp_path, kimi), [batch, "4", *ulysses, *ep]),
            "V4 EP 2 x FSDP 4, op AC": (v4, [batch, "2", *ep, *op_ac]),
            "V4 PP 2 x EP 2 x FSDP": (v4, [batch, "4", *ep, *pp]),
            "V4 TP 2 x EP 2 x FSDP 2, documents": (_packed(tmp_path, v4), [batch, "4", *ep, *tp]),
            "V4 MTP PP 2 x EP 2 x FSDP": (v4_mtp, [batch, "4", *ep, *pp]),
            "V4 MTP TP 2 x EP 2 x FSDP 2, documents": (_packed(tmp_path, v4_mtp), [batch, "4", *ep, *tp]),
            "V3.2 CP 2 x FSDP 2, documents": (_packed(tmp_path, v32), [batch, "4", *cp]),
            "V3.2 CP 2 x TP 2, documents": (_packed(tmp_path, v32), [batch, "8", *cp, *tp]),
            "GLM-5 CP 2 x EP 2, documents": (_packed(tmp_path, glm5), [batch, "4", *cp, *ep]),
            "V4 CP 2 x FSDP 2, documents": (_packed(tmp_path, v4), [batch, "4", *cp]),
            "V4 CP 2 x TP 2, documents": (_packed(tmp_path, v4), [batch, "8", *cp, *tp]),
            "V4 CP 2 x EP 2, documents": (_packed(tmp_path, v4), [batch, "4", *cp, *ep])}


@pytest.mark.ranks
def test_fsdp_ep_pp_cp_and_tp_layouts_equal_one_process(tmp_path):
    """4 ranks, with the bias update on, each equal to one process within 1e-5 (per-step losses and grad norms,
    step-1 gradients, final parameters): FSDP 4; EP 2 x FSDP 4 (experts sharded over both); PP 2 x EP 2 x
    FSDP, whose first stage holds the dense block, under selective op AC (FSDP's work for the experts inside each
    checkpointed block passes SAC uncounted); TP 2 x EP 2 x FSDP 2 (MLA's plan: the rope key's gradient
    summed over TP); TP 2 x FSDP 2 on the plain-query V2 debug model; 2 MTP depths under EP 2 x FSDP 4; and,
    from HF folders, EP 2 x CP 2 on a YaRN-scaled MLA (its softmax scale kept by CP's kernel) and EP 2 x FSDP 4
    on FP8 block-quantized weights (each rank dequantizing its own slices); V3.2's sparse attention (2 dense
    warm-up steps, then top-k) under EP 2 x FSDP 4 with selective op AC, PP 2 x EP 2 x FSDP and TP 2 x EP 2 x
    FSDP 2 (the indexer replicated, the attention it is fitted to summed over the ranks' heads), GLM-5's (a block
    sharing the selection of the one before, read again when full AC recomputes it) under EP 2 x FSDP 4, V3.2 with
    Float8 linears (emulated; the indexer's too) under EP 2 x FSDP 4 within float8's rounding. And DeepSeek V3
    671B's layout in
    small: PP 2 x FSDP 2 in bf16 with an MTP depth kept untrained, whose losses stay within bf16's 2% of one
    fp32 process and whose depth is saved as initialized. Kimi Linear (KDA and NoPE MLA blocks, the same group):
    EP 2 x FSDP 4 under op AC, PP 2 x EP 2 x FSDP (each stage a KDA and an MLA block), TP 2 x EP 2 x FSDP 2 (KDA
    split by head), and on packed documents all-gather CP 2 x TP 2 (KDA by state passing) and Ulysses CP 2 x EP 2
    (its losses, grad norms and step-1 gradients). DeepSeek V4 (sliding, CSA and HCA blocks, mHC streams, a
    hash-routed block): EP 2 x FSDP 4 under op AC, PP 2 x EP 2 x FSDP (the hash-routed block on the first stage), and
    on packed documents TP 2 x EP 2 x FSDP 2 (query heads split, the key/value head, compressors and indexer whole,
    hash routing's token ids cut like the tokens); its two MTP depths under PP 2 x EP 2 x FSDP (on the last stage, fed
    the first stage's embeddings) and on packed documents TP 2 x EP 2 x FSDP 2 (the data ranks'
    shares of each depth's trained targets unequal: the depth's mean counts them over both). All-gather CP on packed
    documents for DSA (V3.2 under CP 2 x FSDP 2 and CP 2 x TP 2, GLM-5 under CP 2 x EP 2: the warm-up's 2 dense
    steps, then each chunk's queries selecting among every earlier latent key) and for V4 (CP 2 x FSDP 2, x TP 2, x
    EP 2: windows reading the chunk before, entries and indexer keys gathered)."""
    from tests.launch import assert_matches, one_process, run_cases
    from tests.test_speed_features import LOW_PRECISION_TOL

    model = ["--model.name", "deepseek_v3", "--moe.load_balance_rate", "1e-2"]
    debug, v2, mtp = ([*model, "--model.flavor", f] for f in ("debugmodel", "debugmodel_v2", "debugmodel_mtp"))
    _theirs(tmp_path / "yarn", vocab_size=300, **_CONFIGS["q_lora_interleaved_yarn"])
    _theirs(tmp_path / "fp8", vocab_size=300, **_CONFIGS["q_lora_interleaved_yarn"])
    _quantize_fp8(tmp_path / "fp8", 16)
    yarn, fp8 = ([*model, "--model.flavor=", "--checkpoint.enable", "--checkpoint.initial_load_in_hf",
                  "--checkpoint.initial_load_path", str(tmp_path / name)] for name in ("yarn", "fp8"))
    batch, pp = "--training.local_batch_size", ["--parallelism.pipeline_parallel_degree", "2",
                                                "--parallelism.pipeline_parallel_microbatch_size", "2"]
    ep, cp, tp = (["--parallelism.expert_parallel_degree", "2"], ["--parallelism.context_parallel_degree", "2"],
                  ["--parallelism.tensor_parallel_degree", "2"])
    kept = [*mtp, "--training.mtp_loss_weight", "0"]
    op_ac = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
    full_ac = ["--activation_checkpoint.mode", "full"]
    v32 = [*model, "--model.flavor", "v32_debugmodel", "--deepseek_v3.dense_warmup_steps", "2"]
    glm5 = [*model, "--model.flavor", "glm5_debugmodel", "--deepseek_v3.dense_warmup_steps", "2"]
    references = [one_process([*m, batch, "8"], 4)
                  for m in (debug, debug, debug, debug, v2, mtp, yarn, fp8, v32, v32, v32, glm5, v32, kept)]
    cases = [[*debug, batch, "2"], [*debug, batch, "2", *ep], [*debug, batch, "4", *ep, *pp, *op_ac],
             [*debug, batch, "4", *ep, *tp], [*v2, batch, "4", *tp], [*mtp, batch, "2", *ep],
             [*yarn, batch, "4", *ep, *cp], [*fp8, batch, "2", *ep], [*v32, batch, "2", *ep, *op_ac],
             [*v32, batch, "4", *ep, *pp], [*v32, batch, "4", *ep, *tp], [*glm5, batch, "2", *ep, *full_ac],
             [*v32, *_FLOAT8, batch, "2", *ep],
             [*kept, batch, "4", *pp, "--training.mixed_precision_param", "bfloat16"]]
    kimi = _later_family_cases(tmp_path, batch, ep, pp, tp, cp, op_ac, v32, glm5)
    results = run_cases(4, [*cases, *([*model, *layout] for model, layout in kimi.values())], 4)
    *exact, float8, bf16 = results[:len(cases)]
    for i, (got, reference) in enumerate(zip(exact, references[:-2], strict=True)):
        # CP's chunks attend in the blockwise kernel, one process in SDPA's: float noise in a gradient near 0 that
        # Adam's first step sign-normalizes moves one final parameter by 1.3e-5; losses, grad norms and step-1
        # gradients are within 1e-5
        assert_matches(got, reference, 1e-5, what=("grads",) if cases[i] is cases[6] else ("grads", "params"))
    # V3.2 under Float8: its rounding may flip a key in or out of a query's top-k once the warm-up ends, so within 5x
    # the tolerance of dense models (still far below what a broken cast gives)
    assert float8["losses"] != references[-2]["losses"] and all(
        abs(a - b) < 5 * LOW_PRECISION_TOL for a, b in zip(float8["losses"], references[-2]["losses"], strict=True))
    assert_matches(bf16, references[-1], 2e-2, what=())
    for (name, (model, _)), got in zip(kimi.items(), results[len(cases):], strict=True):
        try:  # final parameters left out: Adam's first step sign-normalizes gradients near 0 (1e-9 of a mean 5e-4
            assert_matches(got, one_process([*model, batch, "8"], 4), 1e-5)  # in KDA's q, V4's mHC), so float
        except AssertionError as e:  # noise moves them
            raise AssertionError(f"{name}: {e}") from None
    depth = {name for name in references[-1]["params"] if name.startswith("mtp.")}
    assert depth and all(torch.equal(bf16["params"][n], references[-1]["params"][n]) for n in depth)


@pytest.mark.ranks
def test_8_ranks_pp_x_ep_x_fsdp_x_tp_equal_one_process(tmp_path):
    """PP 2 x TP 2 x FSDP 2, EP 2 taking in the TP pairs: the dense block on the first stage."""
    from tests.launch import assert_matches, one_process, run_cases

    model = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--moe.load_balance_rate", "1e-2"]
    layout = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2",
              "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"]
    (got,) = run_cases(8, [[*model, "--training.local_batch_size", "4", *layout]], 4)
    assert_matches(got, one_process([*model, "--training.local_batch_size", "8"], 4), 1e-5, what=("grads", "params"))


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_mtp"])
def test_the_debug_models_train_with_balancing_on(flavor):
    from tests.dist_worker import run_train

    history = run_train(["--model.name", "deepseek_v3", "--model.flavor", flavor, "--training.seq_len", "128",
                         "--training.local_batch_size", "8", "--optimizer.lr", "3e-3"], 40)["history"]
    assert history[-1]["loss"] < history[0]["loss"] - 1.0 and "moe_imbalance" in history[-1]
    if flavor == "debugmodel_mtp":
        assert history[-1]["mtp_loss"] < history[0]["mtp_loss"] - 1.0


@pytest.mark.parametrize("layout", [("tensor",), ("context",), ("pipeline",), ("pipeline", "tensor")])
def test_mtp_trains_under_tp_cp_and_pp_is_refused_under_pp_with_tp_and_kept_untrained_at_weight_0(layout):
    from tessera.config import ConfigError
    from tessera.preflight import validate
    from tessera.schema import parse_args

    argv = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel_mtp",
            *(arg for name in layout for arg in (f"--parallelism.{name}_parallel_degree", "2"))]
    world = 2 ** len(layout)
    if len(layout) > 1:
        with pytest.raises(ConfigError, match="deepseek_v3.mtp_loss_weight: under pipelining the MTP depths take"):
            validate(parse_args(argv), world)
    else:
        validate(parse_args(argv), world)
    validate(parse_args([*argv, "--training.mtp_loss_weight", "0"]), world)
