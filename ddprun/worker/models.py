"""Models the trainer can build: two small ones without batch norm, and torchvision classifiers."""

from __future__ import annotations

from torch import nn


def build_model(name: str, *, num_classes: int, image_size: int) -> nn.Module:
    """A freshly initialised model (parameters drawn from torch's global RNG)."""
    if name == "mlp":
        return _mlp(num_classes=num_classes, image_size=image_size)
    if name == "cnn":
        return _cnn(num_classes=num_classes)
    import torchvision  # only here: it costs a second to import

    extra = {"image_size": image_size} if name.startswith("vit_") else {}
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes, **extra)


def _mlp(*, num_classes: int, image_size: int) -> nn.Module:
    features = 3 * image_size * image_size
    return _he_init(nn.Sequential(
        nn.Flatten(),
        nn.Linear(features, 256), nn.ReLU(inplace=True),
        nn.Linear(256, 128), nn.ReLU(inplace=True),
        nn.Linear(128, num_classes),
    ))


def _cnn(*, num_classes: int) -> nn.Module:
    # No batch norm, so N processes at batch B match 1 process at batch N*B exactly.
    return _he_init(nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(128, num_classes),
    ))


def _he_init(model: nn.Sequential) -> nn.Sequential:
    """He (Kaiming) normal weights and zero biases for the layers followed by a ReLU, as torchvision's
    models initialise themselves. torch's layer default (uniform, gain 1/sqrt(3)) shrinks the signal at
    every layer; without batch norm to undo it, the small cnn then took several epochs to start learning."""
    layers = list(model)
    for layer, after in zip(layers, layers[1:]):
        if isinstance(layer, (nn.Conv2d, nn.Linear)) and isinstance(after, nn.ReLU):
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            nn.init.zeros_(layer.bias)
    return model


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def has_batch_norm(model: nn.Module) -> bool:
    return any(isinstance(module, _BATCH_NORMS) for module in model.modules())
