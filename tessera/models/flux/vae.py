"""The Flux autoencoder (diffusers' `AutoencoderKL` under its module names, so the `vae/` folder of a FLUX.1
release loads as it is): a convolutional encoder to a diagonal Gaussian over `latent_channels` channels at 1/8
(2^(levels-1)) of the resolution and its decoder. Frozen here: training reads the mean, shifted and scaled
(`(z - shift_factor) * scaling_factor`), and sampling decodes the inverse."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class VAEArgs:
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    latent_channels: int = 16
    norm_num_groups: int = 32
    in_channels: int = 3
    scaling_factor: float = 0.3611
    shift_factor: float = 0.1159
    use_quant_conv: bool = False
    use_post_quant_conv: bool = False
    mid_block_add_attention: bool = True

    @classmethod
    def from_config(cls, config: dict) -> "VAEArgs":
        keys = set(cls.__dataclass_fields__)
        values = {k: v for k, v in config.items() if k in keys}
        values["block_out_channels"] = tuple(values.get("block_out_channels", cls.block_out_channels))
        values["shift_factor"] = values.get("shift_factor") or 0.0
        return cls(**values)

    @property
    def scale(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)


class ResnetBlock2D(nn.Module):
    def __init__(self, c_in: int, c_out: int, groups: int):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(groups, c_in, eps=1e-6), nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(groups, c_out, eps=1e-6), nn.Conv2d(c_out, c_out, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else None

    def forward(self, x):
        h = self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(x))))))
        return (self.conv_shortcut(x) if self.conv_shortcut is not None else x) + h


class Attention(nn.Module):
    """One head over all positions, with its group norm and the residual."""

    def __init__(self, c: int, groups: int):
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, c, eps=1e-6)
        self.to_q, self.to_k, self.to_v = nn.Linear(c, c), nn.Linear(c, c), nn.Linear(c, c)
        self.to_out = nn.ModuleList([nn.Linear(c, c)])

    def forward(self, x):
        b, c, h, w = x.shape
        seq = self.group_norm(x).flatten(2).transpose(1, 2)[:, None]  # [b, 1, hw, c]
        out = F.scaled_dot_product_attention(self.to_q(seq), self.to_k(seq), self.to_v(seq))[:, 0]
        return x + self.to_out[0](out).transpose(1, 2).reshape(b, c, h, w)


class MidBlock(nn.Module):
    def __init__(self, c: int, groups: int, attention: bool):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock2D(c, c, groups), ResnetBlock2D(c, c, groups)])
        self.attentions = nn.ModuleList([Attention(c, groups)]) if attention else None

    def forward(self, x):
        x = self.resnets[0](x)
        if self.attentions is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x)


class Resample(nn.Module):
    """Downsample2D (pad right and bottom by 1, 3x3 conv of stride 2) or Upsample2D (nearest x2, 3x3 conv)."""

    def __init__(self, c: int, down: bool):
        super().__init__()
        self.down, self.conv = down, nn.Conv2d(c, c, 3, stride=2 if down else 1, padding=0 if down else 1)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)) if self.down else F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Level(nn.Module):
    def __init__(self, c_in: int, c_out: int, n: int, groups: int, resample: str | None):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock2D(c_in if i == 0 else c_out, c_out, groups) for i in range(n)])
        if resample == "down":
            self.downsamplers = nn.ModuleList([Resample(c_out, down=True)])
        elif resample == "up":
            self.upsamplers = nn.ModuleList([Resample(c_out, down=False)])

    def forward(self, x):
        for resnet in self.resnets:
            x = resnet(x)
        for sampler in getattr(self, "downsamplers", ()) or getattr(self, "upsamplers", ()):
            x = sampler(x)
        return x


class Coder(nn.Module):
    """The encoder (`down`) or the decoder: conv_in, levels and the mid block (in the order of travel), then
    norm, SiLU and conv_out."""

    def __init__(self, a: VAEArgs, down: bool):
        super().__init__()
        chans, g, last = a.block_out_channels, a.norm_num_groups, len(a.block_out_channels) - 1
        self.down = down
        self.conv_in = nn.Conv2d(a.in_channels if down else a.latent_channels, chans[0] if down else chans[-1], 3,
                                 padding=1)
        if down:
            self.down_blocks = nn.ModuleList([
                Level(chans[max(i - 1, 0)], c, a.layers_per_block, g, "down" if i < last else None)
                for i, c in enumerate(chans)])
        else:
            rev = chans[::-1]
            self.up_blocks = nn.ModuleList([
                Level(rev[max(i - 1, 0)], c, a.layers_per_block + 1, g, "up" if i < last else None)
                for i, c in enumerate(rev)])
        self.mid_block = MidBlock(chans[-1], g, a.mid_block_add_attention)
        self.conv_norm_out = nn.GroupNorm(g, chans[0] if not down else chans[-1], eps=1e-6)
        self.conv_out = nn.Conv2d(self.conv_norm_out.num_channels, 2 * a.latent_channels if down else a.in_channels,
                                  3, padding=1)

    def forward(self, x):
        x = self.conv_in(x)
        if self.down:
            for level in self.down_blocks:
                x = level(x)
            x = self.mid_block(x)
        else:
            x = self.mid_block(x)
            for level in self.up_blocks:
                x = level(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


class AutoencoderKL(nn.Module):
    def __init__(self, args: VAEArgs):
        super().__init__()
        self.args = args
        self.encoder, self.decoder = Coder(args, down=True), Coder(args, down=False)
        c = 2 * args.latent_channels
        self.quant_conv = nn.Conv2d(c, c, 1) if args.use_quant_conv else None
        self.post_quant_conv = nn.Conv2d(c // 2, c // 2, 1) if args.use_post_quant_conv else None

    def moments(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, logvar) of the latent Gaussian of images [b, 3, h, w] in [-1, 1]."""
        h = self.encoder(images)
        if self.quant_conv is not None:
            h = self.quant_conv(h)
        mean, logvar = h.chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    def decode_raw(self, z: torch.Tensor) -> torch.Tensor:
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)

    # The flow's view: uint8 [b, h, w, 3] <-> shifted, scaled latents [b, c, h/8, w/8] (the Gaussian's mean).
    @property
    def channels(self) -> int:
        return self.args.latent_channels

    @property
    def scale(self) -> int:
        return self.args.scale

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        pixels = images.permute(0, 3, 1, 2).to(next(self.parameters()).dtype) / 127.5 - 1.0
        return (self.moments(pixels)[0] - self.args.shift_factor) * self.args.scaling_factor

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        pixels = self.decode_raw(latents / self.args.scaling_factor + self.args.shift_factor)
        return ((pixels.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)
