"""Model families exported from PyTorch: ResNet-18..152 and VGG-11..19 at 224x224.

The zoo (:mod:`trims.evaluation.zoo`) holds nine models from nine different families, which
share few layers. DLBricks' model sets held whole families, where deeper members repeat the
blocks of shallower ones; these are the two classic ones, written in plain PyTorch with the
torchvision architectures (ResNet v1.5: the stride on the 3x3 convolution), so no weights or
torchvision are needed. Weights are seeded random values, which do not change run time.

A family model is named ``torch:<arch>`` (``torch:resnet101``) wherever a model is accepted;
:data:`FAMILIES` is the nine of them. :func:`export` traces the model with the TorchScript
ONNX exporter in eval mode (batch norm folded into the convolutions, as deployed models are).
"""

from __future__ import annotations

import io
import logging
import warnings
from typing import TYPE_CHECKING, Any

from trims.errors import NotFound

if TYPE_CHECKING:
    import onnx
    import torch

log = logging.getLogger(__name__)

PREFIX = "torch:"

#: blocks per stage and block kind of each ResNet depth
_RESNETS: dict[str, tuple[tuple[int, int, int, int], bool]] = {
    "resnet18": ((2, 2, 2, 2), False),
    "resnet34": ((3, 4, 6, 3), False),
    "resnet50": ((3, 4, 6, 3), True),
    "resnet101": ((3, 4, 23, 3), True),
    "resnet152": ((3, 8, 36, 3), True),
}

#: convolutions per stage of each VGG depth (64, 128, 256, 512, 512 channels)
_VGGS: dict[str, tuple[int, int, int, int, int]] = {
    "vgg11": (1, 1, 2, 2, 2),
    "vgg13": (2, 2, 2, 2, 2),
    "vgg16": (2, 2, 3, 3, 3),
    "vgg19": (2, 2, 4, 4, 4),
}

#: the family set, ``--models families``
FAMILIES: tuple[str, ...] = tuple(PREFIX + n for n in (*_RESNETS, *_VGGS))


def family_names() -> list[str]:
    """Every ``torch:<arch>`` name :func:`export` accepts."""
    return list(FAMILIES)


def is_family(source: str) -> bool:
    return source.startswith(PREFIX)


def _arch(source: str) -> str:
    arch = source.removeprefix(PREFIX)
    if arch not in _RESNETS and arch not in _VGGS:
        raise NotFound(f"no PyTorch family model {source!r}; choose from {', '.join(FAMILIES)}")
    return arch


def build(source: str, device: str = "cpu") -> torch.nn.Module:
    """The eval-mode PyTorch module for ``torch:<arch>`` with seeded random weights.

    ``device="meta"`` builds the structure without allocating or initializing weights.
    """
    import torch

    arch = _arch(source)
    # seeded without touching the caller's random state
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        module = _resnet(*_RESNETS[arch]) if arch in _RESNETS else _vgg(_VGGS[arch])
    return module.eval()


def export(source: str, batch: int = 1) -> onnx.ModelProto:
    """Export ``torch:<arch>`` to ONNX (opset 17) for input ``[batch, 3, 224, 224]``."""
    return export_module(build(source), source, batch)


def export_module(module: Any, name: str, batch: int = 1) -> onnx.ModelProto:
    """Export an image model taking ``[batch, 3, 224, 224]`` to ONNX (opset 17), the graph
    named ``name``: input ``data``, output ``logits``."""
    import onnx
    import torch

    buffer = io.BytesIO()
    # the TorchScript exporter is deprecated since PyTorch 2.9, but its successor needs
    # onnxscript, which is not a dependency; the warning says nothing the caller can act on
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            module,
            (torch.zeros(batch, 3, 224, 224),),
            buffer,  # type: ignore[arg-type]  # the TorchScript exporter takes file objects
            input_names=["data"],
            output_names=["logits"],
            opset_version=17,
            dynamo=False,
        )
    model = onnx.load_from_string(buffer.getvalue())
    model.graph.name = name
    log.debug("exported %s: %d nodes", name, len(model.graph.node))
    return model


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> list[Any]:
    import torch.nn as nn

    return [
        nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(cout),
    ]


def _resnet(blocks: tuple[int, int, int, int], bottleneck: bool) -> torch.nn.Module:
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, cin: int, planes: int, stride: int) -> None:
            super().__init__()
            cout = planes * (4 if bottleneck else 1)
            if bottleneck:
                body = [
                    *_conv_bn(cin, planes, 1),
                    nn.ReLU(),
                    *_conv_bn(planes, planes, 3, stride),
                    nn.ReLU(),
                    *_conv_bn(planes, cout, 1),
                ]
            else:
                body = [*_conv_bn(cin, planes, 3, stride), nn.ReLU(), *_conv_bn(planes, cout, 3)]
            self.body = nn.Sequential(*body)
            self.down = (
                nn.Sequential(*_conv_bn(cin, cout, 1, stride))
                if stride != 1 or cin != cout
                else nn.Identity()
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.body(x) + self.down(x))

    layers: list[nn.Module] = [*_conv_bn(3, 64, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for stage, count in enumerate(blocks):
        planes = 64 * 2**stage
        for i in range(count):
            layers.append(Block(cin, planes, 2 if i == 0 and stage > 0 else 1))
            cin = planes * (4 if bottleneck else 1)
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 1000)]
    return nn.Sequential(*layers)


def _vgg(convs: tuple[int, int, int, int, int]) -> torch.nn.Module:
    import torch.nn as nn

    layers: list[nn.Module] = []
    cin = 3
    for cout, count in zip((64, 128, 256, 512, 512), convs, strict=True):
        for _ in range(count):
            layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]
            cin = cout
        layers.append(nn.MaxPool2d(2, 2))
    # at 224x224 the features are 7x7 already: torchvision's adaptive pool is the identity there
    layers += [
        nn.Flatten(),
        nn.Linear(512 * 7 * 7, 4096),
        nn.ReLU(),
        nn.Dropout(),
        nn.Linear(4096, 4096),
        nn.ReLU(),
        nn.Dropout(),
        nn.Linear(4096, 1000),
    ]
    return nn.Sequential(*layers)
