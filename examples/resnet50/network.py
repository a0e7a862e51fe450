"""ResNet-50 (He et al., 2015) in plain torch: 25.6 M parameters, 1000 classes, ~98 MiB float32.

The same layer names as the common torchvision layout (conv1, bn1, layer1..4, fc), so a state
dict from there would load too; here the weights come from ``prepare.py`` (seeded random).
"""

from __future__ import annotations

import torch
from torch import nn

#: Bottleneck blocks per stage.
STAGES = (3, 4, 6, 3)
EXPANSION = 4


class Bottleneck(nn.Module):
    def __init__(self, in_channels: int, width: int, stride: int) -> None:
        super().__init__()
        out_channels = width * EXPANSION
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet50(nn.Module):
    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        in_channels = 64
        for i, (blocks, width) in enumerate(zip(STAGES, (64, 128, 256, 512), strict=True)):
            layers = []
            for b in range(blocks):
                stride = 2 if b == 0 and i > 0 else 1
                layers.append(Bottleneck(in_channels, width, stride))
                in_channels = width * EXPANSION
            setattr(self, f"layer{i + 1}", nn.Sequential(*layers))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def random_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded weights: He-initialised convolutions, BatchNorm statistics drawn near identity."""
    generator = torch.Generator().manual_seed(seed)
    net = ResNet50()
    state = {}
    for name, tensor in net.state_dict().items():
        if name.endswith("num_batches_tracked"):
            value = torch.zeros_like(tensor)
        elif name.endswith("running_var"):
            value = 1.0 + 0.1 * torch.rand(tensor.shape, generator=generator)
        elif name.endswith(("running_mean", "bias")):
            value = 0.01 * torch.randn(tensor.shape, generator=generator)
        elif name.endswith("bn3.weight"):
            # Small last-BN scale in each block keeps the residual sum from blowing up.
            value = 0.1 + 0.01 * torch.randn(tensor.shape, generator=generator)
        elif name.endswith("weight") and tensor.dim() == 1:
            value = 1.0 + 0.05 * torch.randn(tensor.shape, generator=generator)
        elif name == "fc.weight":
            value = 0.01 * torch.randn(tensor.shape, generator=generator)
        else:
            fan_in = tensor[0].numel()
            value = torch.randn(tensor.shape, generator=generator) * (2.0 / fan_in) ** 0.5
        state[name] = value.to(tensor.dtype).contiguous()
    return state
