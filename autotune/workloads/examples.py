"""Built-in example workloads, built from code with random weights (nothing is downloaded).

Sizes are chosen so that each fits at least batch 8 in 256 MiB and a probe finishes in seconds
on a CPU: parameters and optimizer state take a good share of the budget, so the answer is
tens of samples rather than thousands.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from autotune.workloads.workload import Precision, Workload


def _cross_entropy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def mlp(
    in_features: int = 1024,
    hidden: int = 1024,
    layers: int = 3,
    classes: int = 100,
    optimizer: str = "adamw",
    precision: str = "fp32",
) -> Workload:
    """A multilayer perceptron classifier on dense features."""

    def build() -> nn.Module:
        dims = [in_features] + [hidden] * layers
        blocks: list[nn.Module] = []
        for a, b in itertools.pairwise(dims):
            blocks += [nn.Linear(a, b), nn.GELU()]
        return nn.Sequential(*blocks, nn.Linear(hidden, classes))

    def batch(b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, in_features, device=device), torch.randint(0, classes, (b,), device=device)

    return Workload(
        name="mlp",
        build_model=build,
        make_batch=batch,
        loss=_cross_entropy,
        optimizer=optimizer,
        precision=Precision(precision),
        input_spec={"in_features": in_features, "classes": classes},
    )


def cnn(
    image_size: int = 64,
    channels: int = 32,
    classes: int = 100,
    optimizer: str = "sgd",
    precision: str = "fp32",
) -> Workload:
    """A small convolutional classifier with BatchNorm (VGG-like stages)."""

    def build() -> nn.Module:
        def stage(c_in: int, c_out: int) -> list[nn.Module]:
            return [
                nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True),
                nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            ]

        c = channels
        return nn.Sequential(
            *stage(3, c),
            *stage(c, 2 * c),
            *stage(2 * c, 4 * c),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(4 * c, classes),
        )

    def batch(b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.randn(b, 3, image_size, image_size, device=device)
        return images, torch.randint(0, classes, (b,), device=device)

    return Workload(
        name="cnn",
        build_model=build,
        make_batch=batch,
        loss=_cross_entropy,
        optimizer=optimizer,
        optimizer_kwargs={"lr": 0.01, "momentum": 0.9} if optimizer == "sgd" else {},
        precision=Precision(precision),
        input_spec={"image_size": image_size, "classes": classes},
    )


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        # (b, t, c) -> (b, heads, t, c/heads)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model (token ids in, next-token logits out)."""

    def __init__(self, vocab_size: int, seq_len: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} must be a multiple of heads {heads}")
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tokens(idx) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def gpt(
    vocab_size: int = 4096,
    seq_len: int = 128,
    width: int = 192,
    layers: int = 4,
    heads: int = 4,
    optimizer: str = "adamw",
    precision: str = "fp32",
) -> Workload:
    """A GPT-style language model at its longest sequence (every sample is `seq_len` tokens)."""

    def batch(b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, vocab_size, (b, seq_len + 1), device=device)
        return tokens[:, :-1], tokens[:, 1:]

    return Workload(
        name="gpt",
        build_model=lambda: GPT(vocab_size, seq_len, width, layers, heads),
        make_batch=batch,
        loss=_cross_entropy,
        optimizer=optimizer,
        precision=Precision(precision),
        input_spec={"vocab_size": vocab_size, "seq_len": seq_len},
    )


EXAMPLES: dict[str, Callable[..., Workload]] = {"mlp": mlp, "cnn": cnn, "gpt": gpt}


def example_names() -> list[str]:
    return sorted(EXAMPLES)
