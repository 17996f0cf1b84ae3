"""Frozen conditioning: the text encoders (T5's sequence features, CLIP's pooled embedding, from transformers) and
the autoencoder, plus the latent <-> token layout (2x2 patches, (text, row, column) ids).

`flux.encoders`: `tiny` (the debug flavor and the tests): random-init T5 and CLIP from in-repo configs, the same on
every rank (seeded), on byte-level ids, and a pixel-space autoencoder, so everything runs offline on CPU and the
samples are pictures; `tiny_vae`: the same encoders and a random-init Flux VAE from an in-repo config; or the folder
of a FLUX.1 release (`scripts/download_hf_assets.py`): text_encoder/ + tokenizer/ (CLIP), text_encoder_2/ +
tokenizer_2/ (T5), vae/. Under data parallelism they are sharded with FSDP like the transformer."""

import json
import os

import torch
from torch import nn

from tessera.models.flux.vae import AutoencoderKL, VAEArgs

TINY_SEED = 1234
EOS, PAD = 257, 0  # byte b is id b + 1


def tokenize(captions: list[str], text_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte ids + EOS, cut to `text_len` (EOS kept, CLIP pools at it), padded; (ids, attention mask)."""
    ids = torch.full((len(captions), text_len), PAD, dtype=torch.long)
    for row, caption in enumerate(captions):
        tokens = [b + 1 for b in caption.encode("utf-8")[:text_len - 1]] + [EOS]
        ids[row, :len(tokens)] = torch.tensor(tokens)
    return ids, (ids != PAD).long()


class TinyTextEncoders(nn.Module):
    def __init__(self, text_len: int, context_dim: int, pooled_dim: int):
        super().__init__()
        from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

        self.text_len = text_len
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(TINY_SEED)
            self.t5 = T5EncoderModel(T5Config(vocab_size=EOS + 1, d_model=context_dim, d_kv=8, num_heads=4,
                                              num_layers=2, d_ff=2 * context_dim, dropout_rate=0.0,
                                              pad_token_id=PAD, eos_token_id=EOS))
            self.clip = CLIPTextModel(CLIPTextConfig(vocab_size=EOS + 1, hidden_size=pooled_dim, num_hidden_layers=2,
                                                     intermediate_size=2 * pooled_dim, num_attention_heads=4,
                                                     max_position_embeddings=text_len, pad_token_id=PAD,
                                                     bos_token_id=EOS - 1, eos_token_id=EOS))
        self.requires_grad_(False).eval()

    @torch.no_grad()
    def forward(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """T5 features [b, text_len, context_dim] and CLIP's pooled embedding [b, pooled_dim]."""
        device = next(self.parameters()).device
        ids, mask = (x.to(device) for x in tokenize(captions, self.text_len))
        return (self.t5(input_ids=ids, attention_mask=mask).last_hidden_state,
                self.clip(input_ids=ids, attention_mask=mask).pooler_output)


class PixelAutoencoder(nn.Module):
    """The tiny flavor's autoencoder: latents are the pixels in [-1, 1] (no weights), so samples decode exactly."""

    channels, scale = 3, 1

    def encode(self, images: torch.Tensor) -> torch.Tensor:  # uint8 [b, h, w, 3] -> [b, 3, h, w]
        return images.permute(0, 3, 1, 2).float() / 127.5 - 1.0

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return ((latents.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """[b, c, h, w] -> [b, (h/2)(w/2), c*4], as diffusers packs Flux latents."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, c * 4)


def unpatchify(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    b, _, cp = tokens.shape
    return tokens.view(b, h // 2, w // 2, cp // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, cp // 4, h, w)


def image_ids(h: int, w: int) -> torch.Tensor:
    """[(h/2)(w/2), 3]: (0, row, column) of each patch."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1], ids[..., 2] = torch.arange(h // 2)[:, None], torch.arange(w // 2)[None]
    return ids.reshape(-1, 3)


TINY_VAE = VAEArgs(block_out_channels=(16, 32), layers_per_block=1, latent_channels=3, norm_num_groups=8,
                   scaling_factor=1.0, shift_factor=0.0)


class ReleasedTextEncoders(nn.Module):
    """CLIP (pooled, 77 tokens) and T5 (sequence, `text_len` tokens) as the FLUX.1 pipeline runs them."""

    def __init__(self, folder: str, text_len: int):
        super().__init__()
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        self.text_len = text_len
        self.clip_tokenizer = AutoTokenizer.from_pretrained(os.path.join(folder, "tokenizer"))
        self.t5_tokenizer = AutoTokenizer.from_pretrained(os.path.join(folder, "tokenizer_2"))
        self.clip = CLIPTextModel.from_pretrained(os.path.join(folder, "text_encoder"))
        self.t5 = T5EncoderModel.from_pretrained(os.path.join(folder, "text_encoder_2"))
        self.requires_grad_(False).eval()

    @torch.no_grad()
    def forward(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        device = next(self.parameters()).device
        clip_len = self.clip.config.max_position_embeddings
        clip_ids = self.clip_tokenizer(captions, padding="max_length", max_length=clip_len, truncation=True,
                                       return_tensors="pt").input_ids.to(device)
        t5_ids = self.t5_tokenizer(captions, padding="max_length", max_length=self.text_len, truncation=True,
                                   return_tensors="pt").input_ids.to(device)
        return self.t5(input_ids=t5_ids).last_hidden_state, self.clip(input_ids=clip_ids).pooler_output


def load_vae(folder: str) -> AutoencoderKL:
    from safetensors.torch import load_file

    with open(os.path.join(folder, "config.json")) as fh:
        vae = AutoencoderKL(VAEArgs.from_config(json.load(fh)))
    vae.load_state_dict(load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors")))
    return vae.requires_grad_(False).eval()


def build_conditioning(kind: str, text_len: int, args, device: torch.device, dp_mesh=None):
    """(text encoders, autoencoder) for `flux.encoders`, frozen, on `device`; FSDP-sharded over `dp_mesh`."""
    if kind in ("tiny", "tiny_vae"):
        text = TinyTextEncoders(text_len, args.context_dim, args.pooled_dim)
        if kind == "tiny":
            return text.to(device), PixelAutoencoder()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(TINY_SEED)
            vae = AutoencoderKL(TINY_VAE).requires_grad_(False).eval()
    else:
        text, vae = ReleasedTextEncoders(kind, text_len), load_vae(os.path.join(kind, "vae"))
    text, vae = text.to(device), vae.to(device)
    if dp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for module in (text.clip, text.t5, vae):
            fully_shard(module, mesh=dp_mesh)
    return text, vae
