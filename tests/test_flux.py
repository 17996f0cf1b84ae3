"""Flux: the transformer against diffusers' FluxTransformer2DModel on tiny random configs that are no preset
(imported under diffusers' names, fp32, within 1e-5), parameter counts (the published ~11.9B; the formula equals
the built model), the rectified-flow objective and the built-in shapes data, training on CPU with the loss
falling and exact resume, and FSDP / CP layouts equal to one process."""

import dataclasses
import json
import os

import pytest
import torch

from tessera.models import family, num_params

FLUX = family("flux")


def _build(args):
    with torch.device("meta"):
        model = FLUX.spec().model(args)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    return model


@pytest.mark.parametrize("flavor", ["flux-schnell", "flux-dev", "flux-debug"])
def test_parameter_counts(flavor):
    args = FLUX.flavors[flavor]
    with torch.device("meta"):
        model = FLUX.spec().model(args)
    assert FLUX.counts(args, 4608).params == num_params(model)
    if flavor != "flux-debug":  # published: 11.90B (schnell, no guidance embedder), 11.90B + 3.9M (dev)
        assert abs(FLUX.counts(args, 4608).params / 1e9 - 11.9) < 0.01


_CONFIGS = {  # no presets: odd widths, RoPE axes that are not the release's, guidance on or off
    "guidance": dict(num_layers=2, num_single_layers=3, attention_head_dim=16, num_attention_heads=3,
                     in_channels=12, joint_attention_dim=20, pooled_projection_dim=10, guidance_embeds=True,
                     axes_dims_rope=(4, 6, 6)),
    "schnell_like": dict(num_layers=1, num_single_layers=2, attention_head_dim=8, num_attention_heads=4,
                         in_channels=16, joint_attention_dim=24, pooled_projection_dim=12, guidance_embeds=False,
                         axes_dims_rope=(2, 2, 4)),
}


# No preset either, with the widths of the tiny encoders' features (T5 32, CLIP 32) and latents (3 x 2 x 2).
_SAMPLED = dict(num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=3, in_channels=12,
                joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))


def _ids(n_txt: int, h: int, w: int):
    img = torch.zeros(h, w, 3)
    img[..., 1], img[..., 2] = torch.arange(h)[:, None], torch.arange(w)[None]
    return img.reshape(-1, 3), torch.zeros(n_txt, 3)


@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_transformer_equals_diffusers(tmp_path, name):
    diffusers = pytest.importorskip("diffusers")
    config = _CONFIGS[name]
    torch.manual_seed(0)
    theirs = diffusers.FluxTransformer2DModel(**config).eval()
    with torch.no_grad():  # diffusers starts some projections at 0: make every weight count
        for p in theirs.parameters():
            p.normal_(0, 0.15)
    theirs.save_pretrained(tmp_path)
    args = FLUX.hf.args_from_hf_config(theirs.config)
    ours = _build(args).eval()
    from safetensors.torch import load_file
    ours.load_state_dict(FLUX.hf.from_hf(load_file(tmp_path / "diffusion_pytorch_model.safetensors")))
    _assert_equal_outputs(ours, theirs, args)
    assert FLUX.hf.to_hf(ours.state_dict()).keys() == theirs.state_dict().keys()
    assert FLUX.hf.hf_config(args)["axes_dims_rope"] == list(config["axes_dims_rope"])
    assert dataclasses.replace(args) == FLUX.hf.args_from_hf_config(FLUX.hf.hf_config(args))


def _assert_equal_outputs(ours, theirs, args) -> None:
    """Ours and diffusers' model give the same velocity (within 1e-5) on random latents, captions and times."""
    gen = torch.Generator().manual_seed(1)
    b, n_txt, h, w = 2, 5, 3, 4
    img_ids, txt_ids = _ids(n_txt, h, w)
    inputs = dict(img=torch.randn(b, h * w, args.in_channels, generator=gen),
                  txt=torch.randn(b, n_txt, args.context_dim, generator=gen),
                  pooled=torch.randn(b, args.pooled_dim, generator=gen), t=torch.rand(b, generator=gen),
                  img_ids=img_ids, txt_ids=txt_ids,
                  guidance=torch.full((b,), 3.5) if args.guidance_embed else None)
    with torch.no_grad():
        got = ours(**inputs)
        want = theirs(hidden_states=inputs["img"], encoder_hidden_states=inputs["txt"],
                      pooled_projections=inputs["pooled"], timestep=inputs["t"], img_ids=img_ids, txt_ids=txt_ids,
                      guidance=inputs["guidance"]).sample
    assert want.abs().max() > 1.0  # the outputs are not vanishing
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_diffusers_folder_opens_for_inference(tmp_path, capsys):
    """A FluxTransformer2DModel folder as diffusers saves it (sharded, as a release's transformer/; no preset), and
    Tessera's export of it, open with tessera.from_pretrained (config.json names _class_name, not model_type) and
    compute what diffusers' model does; the export has no language model's generation_config.json. python -m
    tessera.generate hands such a folder to Flux's sampler, with the encoders of the release it sits in."""
    diffusers = pytest.importorskip("diffusers")
    from tessera import from_pretrained
    from tessera.checkpoint.hf import save_hf
    from tessera.generate import main

    torch.manual_seed(0)
    theirs = diffusers.FluxTransformer2DModel(**_SAMPLED).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.15)
    folder = tmp_path / "release" / "transformer"
    theirs.save_pretrained(folder, max_shard_size="100KB")
    assert "model_type" not in json.loads((folder / "config.json").read_text())
    assert len(list(folder.glob("diffusion_pytorch_model-*.safetensors"))) > 1
    ours, _ = from_pretrained(folder)
    _assert_equal_outputs(ours, theirs, ours.args)
    save_hf(ours, ours.args, tmp_path / "export", bos_id=1, eos_id=2)
    assert not (tmp_path / "export" / "generation_config.json").exists()
    _assert_equal_outputs(from_pretrained(tmp_path / "export")[0], theirs, ours.args)
    argv = ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(folder), "--generate.prompt",
            "a big red circle in the middle", "--flux.sample_steps", "1", "--job.dump_folder", str(tmp_path / "out")]
    assert main(argv) == 0 and (tmp_path / "out" / "samples" / "generate-0.png").is_file()
    for part in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "vae"):  # a release's parts beside
        (tmp_path / "release" / part).mkdir()
    (tmp_path / "release" / "vae" / "config.json").write_text(json.dumps({"latent_channels": 16,
                                                                         "block_out_channels": [128, 256, 512, 512]}))
    capsys.readouterr()
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"tessera.generate: flux.encoders: '{tmp_path / 'release'}' makes 64 input channels (latent "
        f"channels x 2 x 2), but the model in '{folder}' takes 12; pass the release folder it came with\n")


MODEL = ["--model.name", "flux", "--model.flavor", "flux-debug", "--training.seq_len", "112",
         "--training.dataset", "shapes", "--optimizer.lr", "1e-3"]


def _loader(split="train", dp_rank=0, dp=1, batch=8, *flags):
    from tessera.models.flux.data import FluxLoader
    from tessera.schema import parse_args
    from tests.launch import merge

    cfg = parse_args(merge(MODEL, ["--training.local_batch_size", str(batch)], flags))
    return FluxLoader(cfg, FLUX.flavors["flux-debug"], dp_rank, dp, torch.device("cpu"), split)


def test_rectified_flow_batch_and_shapes_data():
    """x_t = (1 - t) x0 + t eps with target eps - x0, x0 the image's latents; logit-normal t; the captions'
    dropout near its probability; ranks take disjoint samples whose union is the one-process batch; the held-out
    split is other images at the fixed timesteps; a caption names what is drawn where."""
    from tessera.models.flux import shapes
    from tessera.models.flux.encoders import unpatchify

    loader = _loader(batch=64)
    inputs, target = loader.next_batch()
    images, captions = loader.pairs(list(range(64)))
    x0, txt, pooled = loader.encode(images, captions)
    t = inputs["t"][:, None, None]
    torch.testing.assert_close(inputs["img"], (1 - t) * x0 + t * (target + x0), rtol=0, atol=1e-6)
    eps = target + x0
    assert abs(eps.mean()) < 0.02 and abs(eps.std() - 1) < 0.02 and 0.35 < inputs["t"].mean() < 0.65
    dropped = (inputs["txt"].abs().sum((1, 2)) == 0).float().mean()
    assert 0.0 < dropped < 0.3 and torch.equal(inputs["txt"][inputs["txt"].abs().sum((1, 2)) > 0],
                                               txt[inputs["txt"].abs().sum((1, 2)) > 0])
    halves = [_loader(dp_rank=r, dp=2, batch=32).next_batch() for r in range(2)]
    torch.testing.assert_close(torch.cat([h[0]["img"].view(32, 1, -1) for h in halves], 1).view(64, -1),
                               inputs["img"].view(64, -1), rtol=0, atol=0)
    vae_batch, _ = _loader("train", 0, 1, 2, "--flux.encoders", "tiny_vae", "--training.seq_len", "64").next_batch()
    assert vae_batch["img"].shape == (2, 16, 12)  # the tiny VAE halves 16 px: 8 x 8 latents in 4 x 4 patches
    val, _ = _loader("validation", batch=6).next_batch()
    assert val["t"].tolist() == [0.25, 0.5, 0.75] * 2
    image, caption = shapes.draw(0, "validation", 0, resolution=32)
    train_image, train_caption = shapes.draw(0, "train", 0, resolution=32)
    assert caption != train_caption or not (image == train_image).all()
    color = next(c for c in shapes.COLORS if c in caption)
    x, y = (int(v * 32) for v in shapes.PLACES[next(p for p in shapes.PLACES if caption.endswith(p))])
    assert tuple(image[y, x]) == shapes.COLORS[color]
    torch.testing.assert_close(unpatchify(x0, 16, 16)[0], loader.autoencoder.encode(images)[0])


def test_a_runs_loaders_share_its_encoders_and_the_next_run_builds_its_own():
    """The frozen encoders are the run's: built once by the family's data hook for all its loaders (the training
    and validation ones use the same modules), and nothing kept in the process hands them to the next run."""
    from types import SimpleNamespace

    from tessera.models.flux.data import build_loaders
    from tessera.schema import parse_args

    cfg = parse_args(MODEL)
    world = SimpleNamespace(rank=0, dp_rank=0, dims=SimpleNamespace(dp=1), device=torch.device("cpu"),
                            dp_mesh=lambda: None)
    runs = [build_loaders(cfg, world, FLUX.flavors["flux-debug"], ("train", "validation")) for _ in range(2)]
    for loaders in runs:
        assert [loader.split for loader in loaders.values()] == ["train", "validation"]
        assert loaders["train"].text is loaders["validation"].text
        assert loaders["train"].autoencoder is loaders["validation"].autoencoder
    assert runs[0]["train"].text is not runs[1]["train"].text


@pytest.mark.ranks
def test_a_two_rank_run_resumes_on_one_rank_with_the_same_samples(tmp_path):
    """FSDP 2 with checkpoints every 3 steps, resumed from step 3 on one rank: the same global samples each step
    (none twice, none skipped), the losses and final parameters within 1e-5 (another reduction order)."""
    from tests.dist_worker import run_train
    from tests.launch import resume_copy, run_cases

    ckpt = [*MODEL, "--checkpoint.enable", "--checkpoint.interval", "3"]
    (full,) = run_cases(2, [[*ckpt, "--job.dump_folder", str(tmp_path / "run"),
                                       "--training.local_batch_size", "4"]], 6, mode="train")
    one = run_train([*ckpt, "--job.dump_folder", str(resume_copy(tmp_path / "run", tmp_path / "one", 3)),
                     "--training.local_batch_size", "8"], 6)
    assert one["start"] == 3
    for step in range(4, 7):
        assert sorted(one["samples"][step]) == sorted(full["samples"][step])
        assert abs(one["losses"][step] - full["losses"][step]) < 1e-5
    for name, value in one["params"].items():
        torch.testing.assert_close(value, full["params"][name], rtol=1e-5, atol=1e-5)


def test_the_debug_model_trains_and_resumes_exactly(tmp_path):
    """60 steps on the shapes: the loss falls; a run resumed from its step-30 checkpoint takes the same steps
    31-60, bit for bit (data position, noise, timesteps, dropout, optimizer and RNG all restored)."""
    from tests.launch import resume_copy, run_local

    run = [*MODEL, "--training.steps", "40", "--training.local_batch_size", "8", "--checkpoint.enable",
           "--checkpoint.interval", "20", "--lr_scheduler.warmup_steps", "5", "--training.max_norm", "1.0",
           "--flux.sample_freq", "30", "--flux.sample_steps", "2", "--metrics.enable_tensorboard"]
    full = run_local(tmp_path / "full", *run)
    assert full[-1]["loss"] < 0.6 * full[0]["loss"] and full[-1]["samples_per_s"] > 0
    assert sorted(os.listdir(tmp_path / "full" / "samples")) == ["step-000030.png", "step-000040.png"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "full" / "tb"), size_guidance={"images": 0}).Reload()
    assert [e.step for e in events.Images("samples")] == [30, 40]
    resumed = run_local(resume_copy(tmp_path / "full", tmp_path / "resumed", 20), *run)[40:]  # after the copied
    assert [m["step"] for m in resumed] == list(range(21, 41))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in full[20:]]


@pytest.mark.ranks
def test_fsdp_cp_ac_and_compile_equal_one_process(tmp_path):
    """2 ranks: FSDP 2; CP 2 (each rank a chunk of the text and of the image tokens, bidirectional joint attention
    over the gathered keys and values); FSDP 2 with full AC and compiled blocks (and loss); FSDP 2 with selective
    (op) AC. 4 ranks: HSDP 2x2; CP 2 x FSDP 2.
    Losses, step-1 gradients and final parameters within 1e-5 of one process over the same global batch."""
    from tests.launch import assert_matches, one_process, run_cases

    batch, cp = "--training.local_batch_size", ["--parallelism.context_parallel_degree", "2"]
    reference = one_process([*MODEL, batch, "8"], 3)
    ac = "--activation_checkpoint.mode"
    cases = [[*MODEL, batch, "4"], [*MODEL, batch, "8", *cp], [*MODEL, batch, "4", ac, "full", "--compile.enable"],
             [*MODEL, batch, "4", ac, "selective", "--activation_checkpoint.selective_ac_option", "op"]]
    for got in run_cases(2, cases, 3):
        assert_matches(got, reference, 1e-5, what=("grads", "params"))
    hsdp = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]
    for got in run_cases(4, [[*MODEL, batch, "2", *hsdp], [*MODEL, batch, "4", *cp]], 3):  # HSDP 2x2,
        assert_matches(got, reference, 1e-5, what=("grads", "params"))  # CP 2 x FSDP 2


@pytest.mark.parametrize("quant", [False, True])
def test_vae_equals_diffusers(tmp_path, quant):
    """Our AutoencoderKL, loaded from a diffusers folder (Flux's layout without quant convs; SD's with them):
    the latent Gaussian's mean and log-variance and the decoded images within 1e-5."""
    diffusers = pytest.importorskip("diffusers")
    from safetensors.torch import load_file

    from tessera.models.flux.vae import AutoencoderKL, VAEArgs

    torch.manual_seed(0)
    theirs = diffusers.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
                                     up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(8, 16, 16),
                                     layers_per_block=1, latent_channels=4, norm_num_groups=4, shift_factor=0.1,
                                     scaling_factor=0.4, use_quant_conv=quant, use_post_quant_conv=quant).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # biases and norms away from their 0 / 1 starts
    theirs.save_pretrained(tmp_path)
    ours = AutoencoderKL(VAEArgs.from_config(dict(theirs.config))).eval()
    ours.load_state_dict(load_file(tmp_path / "diffusion_pytorch_model.safetensors"))
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        dist = theirs.encode(x).latent_dist
        mean, logvar = ours.moments(x)
        torch.testing.assert_close(mean, dist.mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logvar, dist.logvar, rtol=1e-5, atol=1e-5)
        z = torch.randn(2, 4, 4, 4)
        torch.testing.assert_close(ours.decode_raw(z), theirs.decode(z).sample, rtol=1e-5, atol=1e-5)


def _release(folder, context_dim=32, pooled_dim=32):
    """A FLUX.1-shaped release folder with tiny random parts: CLIP and T5 with a word-level tokenizer each, and a
    diffusers AutoencoderKL of 3 latent channels at 1/2 scale (so flux-debug's 12 input channels fit)."""
    import diffusers
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[PAD]", "[UNK]", "</s>", "a", "big", "small", "red", "circle", "square", "in", "the", "middle"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")
    for sub in ("tokenizer", "tokenizer_2"):
        fast.save_pretrained(folder / sub)
    torch.manual_seed(0)
    transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=len(words), hidden_size=pooled_dim, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=12, eos_token_id=2)).save_pretrained(folder / "text_encoder")
    transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=len(words), d_model=context_dim, d_kv=8, num_heads=2, num_layers=1,
        d_ff=64)).save_pretrained(folder / "text_encoder_2")
    diffusers.AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                            block_out_channels=(8, 16), layers_per_block=1, latent_channels=3, norm_num_groups=4,
                            shift_factor=0.1, scaling_factor=0.5).save_pretrained(folder / "vae")


def test_released_encoders_and_vae_load_from_a_folder_and_train(tmp_path):
    """flux.encoders = a release folder: T5 features, CLIP's pooled embedding and the VAE latents equal those of
    transformers' and diffusers' own models loaded from it; the trainer runs on it; a folder missing a part is
    refused in one line."""
    pytest.importorskip("diffusers")
    import diffusers
    import transformers

    from tessera.config import ConfigError
    from tessera.models.flux.data import FluxLoader
    from tessera.models.flux.encoders import patchify
    from tessera.preflight import validate
    from tessera.schema import parse_args
    from tests.launch import merge, run_local

    _release(tmp_path / "flux")
    flags = merge(MODEL, ["--flux.encoders", str(tmp_path / "flux"), "--flux.resolution", "16", "--flux.text_len", "8",
                          "--training.seq_len", "24", "--training.local_batch_size", "4"])
    cfg = parse_args(flags)
    validate(cfg, 1)
    loader = FluxLoader(cfg, FLUX.flavors["flux-debug"], 0, 1, torch.device("cpu"))
    images, captions = loader.pairs(list(range(4)))
    x0, txt, pooled = loader.encode(images, captions)
    t5_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "flux" / "tokenizer_2")
    ids = t5_tok(captions, padding="max_length", max_length=8, truncation=True, return_tensors="pt").input_ids
    t5 = transformers.T5EncoderModel.from_pretrained(tmp_path / "flux" / "text_encoder_2")
    clip = transformers.CLIPTextModel.from_pretrained(tmp_path / "flux" / "text_encoder")
    clip_ids = t5_tok(captions, padding="max_length", max_length=12, truncation=True, return_tensors="pt").input_ids
    vae = diffusers.AutoencoderKL.from_pretrained(tmp_path / "flux" / "vae")
    with torch.no_grad():
        torch.testing.assert_close(txt, t5(input_ids=ids).last_hidden_state, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pooled, clip(input_ids=clip_ids).pooler_output, rtol=1e-5, atol=1e-5)
        mean = vae.encode(images.permute(0, 3, 1, 2).float() / 127.5 - 1).latent_dist.mean
        torch.testing.assert_close(x0, patchify((mean - 0.1) * 0.5), rtol=1e-5, atol=1e-5)
    history = run_local(tmp_path / "run", *flags, "--training.steps", "3")
    assert len(history) == 3
    import shutil
    shutil.rmtree(tmp_path / "flux" / "tokenizer_2")
    with pytest.raises(ConfigError, match=r"flux.encoders: .* \(no tokenizer_2\)"):
        validate(parse_args(flags), 1)


def _pictures(n: int):
    from PIL import Image

    for i in range(n):
        yield Image.new("RGB", (24 + i, 20), (10 * i, 255 - 10 * i, 7 * i)), f"picture {i}"


def test_folder_jsonl_and_webdataset_pairs_resume_and_split_across_ranks(tmp_path):
    """The same 120 pictures as a folder of image + .txt files, as a jsonl, as two tar shards (cc12m's layout) and as
    a Hugging Face dataset (an imagefolder read by datasets.load_dataset):
    the three read the same pairs (resized, center-cropped), their captions and the jsonl saved with a UTF-8
    byte-order mark (which is no part of a caption); two ranks take disjoint samples whose union is one
    rank's; a loader restored from a state continues with the same samples; 1 in 100 is held out."""
    import io
    import shutil
    import tarfile

    from tessera.models.flux.pairs import Pairs

    (tmp_path / "folder").mkdir()
    lines, shards = [], [tarfile.open(tmp_path / f"shard-{k}.tar", "w") for k in range(2)]
    for i, (image, caption) in enumerate(_pictures(120)):
        image.save(tmp_path / "folder" / f"{i:04d}.png")
        (tmp_path / "folder" / f"{i:04d}.txt").write_text(caption, encoding="utf-8-sig")
        lines.append(json.dumps({"image": f"folder/{i:04d}.png", "caption": caption}))
        for name, data in ((f"{i:04d}.png", (tmp_path / "folder" / f"{i:04d}.png").read_bytes()),
                           (f"{i:04d}.txt", caption.encode("utf-8-sig"))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            shards[i // 60].addfile(info, io.BytesIO(data))
    for shard in shards:
        shard.close()
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines) + "\nnot json\n", encoding="utf-8-sig")
    shutil.copytree(tmp_path / "folder", tmp_path / "hub", ignore=shutil.ignore_patterns("*.txt"))
    (tmp_path / "hub" / "metadata.jsonl").write_text("\n".join(  # the pictures as a datasets imagefolder
        json.dumps({"file_name": f"{i:04d}.png", "caption": c}) for i, (_, c) in enumerate(_pictures(120))))
    sources = [("folder", str(tmp_path / "folder")), ("jsonl", str(tmp_path / "pairs.jsonl")),
               ("webdataset", str(tmp_path / "shard-*.tar")), ("hub", str(tmp_path / "hub"))]
    read = [[Pairs(kind, path, "train", 0, 16)(i) for i in range(130)] for kind, path in sources]
    for other in read[1:]:
        assert [c for _, c in other] == [c for _, c in read[0]]
        assert all((a == b).all() for (a, _), (b, _) in zip(other, read[0], strict=True))
    assert read[0][0][0].shape == (16, 16, 3) and len({c for _, c in read[0][:118]}) == 118  # an epoch: no repeats
    assert [c for _, c in [Pairs("folder", sources[0][1], "validation", 0, 16)(0)]] == ["picture 0"]
    flags = ["--training.dataset", "webdataset", "--training.dataset_path", sources[2][1]]
    one = _loader("train", 0, 1, 8, *flags)
    batches = [one.next_batch()[0]["img"] for _ in range(2)]
    ranks = [_loader("train", r, 2, 4, *flags) for r in range(2)]
    first = [r.next_batch()[0]["img"] for r in ranks]
    torch.testing.assert_close(torch.stack(first, 1).flatten(0, 1), batches[0], rtol=0, atol=0)
    resumed = _loader("train", 0, 1, 8, *flags)
    resumed.load_state_dict(one.state_dict())
    one_next = one.next_batch()[0]["img"]
    torch.testing.assert_close(resumed.next_batch()[0]["img"], one_next, rtol=0, atol=0)


def test_trainer_imports_and_exports_diffusers_weights(tmp_path):
    """A diffusers FluxTransformer2DModel folder (no preset: 3 heads of 16, guidance embedding) starts a run
    (flavor from its config.json); at lr 0 the exported weights, loaded by diffusers' from_pretrained, equal the
    imported ones exactly."""
    diffusers = pytest.importorskip("diffusers")
    from tests.launch import merge, run_local

    torch.manual_seed(0)
    theirs = diffusers.FluxTransformer2DModel(**_SAMPLED)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.05)
    theirs.save_pretrained(tmp_path / "in")
    run_local(tmp_path / "run", *merge(MODEL, [
        "--model.flavor=", "--training.steps", "1", "--optimizer.lr", "0", "--lr_scheduler.warmup_steps", "0",
        "--checkpoint.enable", "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path",
        str(tmp_path / "in"), "--checkpoint.last_save_in_hf"]))
    exported = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "run" / "checkpoint/exports/step-1")
    assert exported.config.guidance_embeds and exported.config.num_attention_heads == 3
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[key], value, rtol=0, atol=0, msg=key)


def test_configs_check_and_refusals(tmp_path):
    """The schnell/dev configs hold together on 8 ranks (seq_len = text + image tokens at 512 px through a 16-channel,
    1/8 VAE; with CP 2 too) given a release folder and data; what Flux does not do is refused in one line that
    names the key and the fix: TP and PP (with why), a seq_len that is not text + image tokens, missing data."""
    from tessera.config import ConfigError
    from tessera.preflight import validate
    from tessera.schema import parse_args

    release = tmp_path / "release"
    for part in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "vae"):
        (release / part).mkdir(parents=True)
    (release / "vae" / "config.json").write_text(json.dumps({"latent_channels": 16,
                                                             "block_out_channels": [128, 256, 512, 512]}))
    (tmp_path / "shard-0.tar").write_bytes(b"")
    ready = ["--flux.encoders", str(release), "--training.dataset_path", str(tmp_path / "*.tar"),
             "--job.dump_folder", str(tmp_path / "out")]
    for name in ("flux_schnell", "flux_dev"):
        config = ["--job.config_file", f"configs/{name}.toml"]
        with pytest.raises(ConfigError, match="training.dataset_path: nothing at 'data/cc12m/"):
            validate(parse_args(config), 8)
        assert validate(parse_args([*config, *ready]), 8).dims.dp_shard == 8
        assert validate(parse_args([*config, *ready, "--parallelism.context_parallel_degree", "2"]), 8).dims.cp == 2
    base = ["--job.config_file", "configs/flux_debug.toml", "--job.dump_folder", str(tmp_path / "d")]
    for flags, message in (
            (["--parallelism.tensor_parallel_degree", "2"], "tensor_parallel_degree: flux flux-debug is trained "
                                                            "with FSDP/HSDP and CP, not TP"),
            (["--parallelism.pipeline_parallel_degree", "2"], "pipeline_parallel_degree: .* two streams"),
            (["--training.seq_len", "100"], r"training.seq_len: 100, .* set --training.seq_len 112"),
            (["--flux.encoders", str(tmp_path)], r"flux.encoders: .* \(no text_encoder, "),
            (["--flux.encoders", str(release)], "model.flavor: 'flux-debug' takes 12 input channels"),
            (["--training.dataset", "stdlib"], "training.dataset: 'stdlib' is not an image-caption dataset"),
            (["--model.attn_mask_type", "block_causal"], "model.attn_mask_type: 'block_causal' masks packed")):
        with pytest.raises(ConfigError, match=message):
            validate(parse_args([*base, *flags]), 2)


def test_euler_sampling_follows_the_flow_and_generate_writes_a_grid(tmp_path):
    """Given the exact velocity of the straight path to a target image ((x_t - x0) / t), the Euler sampler lands on
    that image (guided or not); `python -m tessera.generate` draws a grid from a trained checkpoint."""
    from PIL import Image

    from tessera.generate import main as tessera_generate
    from tessera.images import grid
    from tessera.models.flux import sample
    from tessera.models.flux.encoders import patchify
    from tests.launch import merge, run_local

    loader = _loader(batch=2)
    target, captions = loader.pairs([0, 1])
    x0 = patchify(loader.autoencoder.encode(target))

    class Exact(torch.nn.Module):
        def forward(self, img, t, **_):
            return (img - x0) / t[:, None, None]

    for scale in (1.0, 4.0):
        images = sample.sample(Exact(), loader, captions, steps=7, scale=scale, seed=3)
        assert (torch.from_numpy(images).int() - target.int()).abs().max() <= 1
    assert grid(images, cols=2).shape == (2 + 18, 2 + 2 * 18, 3)
    run_local(tmp_path / "run", *merge(MODEL, ["--training.steps", "2", "--checkpoint.enable"]))
    argv = ["--job.dump_folder", str(tmp_path / "run"), "--generate.prompt", "a big red circle in the middle",
            "--flux.sample_steps", "2"]
    assert tessera_generate(argv) == 0  # the common entry point hands Flux checkpoints to Flux's sampler
    assert tessera_generate([*argv, "--generate.seed", "5"]) == 0 and (tmp_path / "run/samples/generate-5.png").exists()
    assert Image.open(tmp_path / "run" / "samples" / "generate-0.png").size == ((2 + 4 * 18) * 4, (2 + 18) * 4)


def test_a_cached_run_equals_an_encoding_one(tmp_path):
    """Latents and text features precomputed once (the cache command) give the same losses as encoding every step,
    bit for bit, through 1.3 passes over 40 pairs (noise, t and dropout still drawn per sample)."""
    from tessera import cache
    from tests.launch import merge, run_local

    run = merge(MODEL, ["--flux.shapes_pairs", "40", "--training.steps", "7", "--validation.enable"])
    assert cache.main([*run, "--flux.latent_cache", str(tmp_path / "cache")]) == 0
    assert sorted(os.listdir(tmp_path / "cache")) == ["train", "validation"]
    encoded = run_local(tmp_path / "encoded", *run)
    cached = run_local(tmp_path / "cached", *run, "--flux.latent_cache", str(tmp_path / "cache"))
    assert [m["loss"] for m in cached] == [m["loss"] for m in encoded]


def test_bfl_names_both_ways_agree_with_diffusers_converter():
    """Our export to Black Forest Labs' names, read by diffusers' own single-file converter, gives back every tensor
    exactly; our import of BFL names inverts the export. The converter fixes the hidden size at 3072, so the
    tensors keep the released dim-0 sizes (which the fused splits depend on) with a width of 1."""
    single_file = pytest.importorskip("diffusers.loaders.single_file_utils")
    from tessera.models.flux import bfl
    from tessera.models.flux.args import FluxArgs

    with torch.device("meta"):
        model = FLUX.spec().model(FluxArgs(n_double=2, n_single=2, guidance_embed=True))
    gen = torch.Generator().manual_seed(0)
    ours = {k: torch.randn(v.shape[0], *([1] if v.dim() > 1 else []), generator=gen)
            for k, v in model.state_dict().items()}
    exported = bfl.to_bfl(ours)
    assert "single_blocks.1.linear1.weight" in exported and "double_blocks.0.img_attn.qkv.bias" in exported
    theirs = single_file.convert_flux_transformer_checkpoint_to_diffusers(dict(exported))
    assert theirs.keys() == ours.keys()
    imported = bfl.from_bfl(exported)
    for key, value in ours.items():
        torch.testing.assert_close(theirs[key], value, rtol=0, atol=0, msg=key)
        torch.testing.assert_close(imported[key], value, rtol=0, atol=0, msg=key)


def test_vae_bfl_names_both_ways_agree_with_diffusers_converter():
    """The autoencoder in BFL's ae.safetensors names (latent-diffusion layout), read by diffusers' converter, gives
    back our (diffusers') tensors exactly; our import inverts our export."""
    single_file = pytest.importorskip("diffusers.loaders.single_file_utils")
    from tessera.models.flux import bfl
    from tessera.models.flux.vae import AutoencoderKL, VAEArgs

    args = VAEArgs(block_out_channels=(8, 16, 16), layers_per_block=1, latent_channels=4, norm_num_groups=4)
    gen = torch.Generator().manual_seed(0)
    ours = {k: torch.randn(v.shape, generator=gen) for k, v in AutoencoderKL(args).state_dict().items()}
    exported = bfl.vae_to_bfl(ours, 3)
    assert "decoder.up.0.block.1.conv1.weight" in exported and exported["encoder.mid.attn_1.q.weight"].dim() == 4
    config = {"down_block_types": ("DownEncoderBlock2D",) * 3, "up_block_types": ("UpDecoderBlock2D",) * 3,
              "layers_per_block": 1}
    theirs = single_file.convert_ldm_vae_checkpoint(dict(exported), config)
    imported = bfl.vae_from_bfl(exported, 3)
    assert theirs.keys() == ours.keys() == imported.keys()
    for key, value in ours.items():
        torch.testing.assert_close(theirs[key], value, rtol=0, atol=0, msg=key)
        torch.testing.assert_close(imported[key], value, rtol=0, atol=0, msg=key)


def test_convert_runs_the_bfl_conversions_both_ways(tmp_path, capsys):
    """`python -m tessera.convert` runs the family's own conversions (ModelSpec.convert): BFL's single file to a
    diffusers folder and back gives every tensor exactly; an unknown mode, or one without its family, is refused
    in one line, and an existing destination is not overwritten."""
    from safetensors.torch import load_file, save_file

    from tessera.convert import main
    from tessera.models.flux import bfl

    with torch.device("meta"):
        model = FLUX.spec().model(FLUX.flavors["flux-debug"])
    gen = torch.Generator().manual_seed(0)
    ours = {k: torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
    save_file(bfl.to_bfl(ours), tmp_path / "flux1.safetensors")
    assert main(["bfl-to-diffusers", str(tmp_path / "flux1.safetensors"), str(tmp_path / "folder"),
                 "--model.name", "flux"]) == 0
    imported = load_file(tmp_path / "folder" / "diffusion_pytorch_model.safetensors")
    assert imported.keys() == ours.keys() and (tmp_path / "folder" / "config.json").is_file()
    assert main(["diffusers-to-bfl", str(tmp_path / "folder"), str(tmp_path / "back.safetensors"),
                 "--model.name", "flux"]) == 0
    back = load_file(tmp_path / "back.safetensors")
    for key, value in bfl.to_bfl(ours).items():
        torch.testing.assert_close(back[key], value, rtol=0, atol=0, msg=key)
    for argv, says in [(["bfl-to-diffusers", "flux1.safetensors", "new"], "needs --model.name"),
                       (["to-bfl", "folder", "x.safetensors", "--model.name", "flux"], "flux's conversions are"),
                       (["diffusers-to-bfl", "folder", "back.safetensors", "--model.name", "flux"], "already exists")]:
        with pytest.raises(SystemExit) as e:
            main([str(tmp_path / a) if i in (1, 2) else a for i, a in enumerate(argv)])
        assert e.value.code == 2 and says in capsys.readouterr().err
