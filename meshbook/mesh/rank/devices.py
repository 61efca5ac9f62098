"""Tensors arriving from the notebook (or another rank) land on the rank's device.

The notebook side is CPU: whatever a rank receives, through ``push``/``scatter`` or as an
actor's arguments, arrives as CPU tensors, and is moved to the rank's ``device`` (its GPU on
an NCCL mesh) inside lists, tuples and dicts (a state_dict, a batch), parameters staying
parameters. A CPU mesh keeps them as they are.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any


def on_device(value: Any, device: Any) -> Any:
    """``value`` with its tensors and modules on ``device`` (a ``torch.device``)."""
    if device.type == "cpu":
        return value
    return walk(value, lambda leaf: _onto(device, leaf))


def walk(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``leaf`` applied inside lists, tuples and dicts."""
    if type(value) in (list, tuple):
        return type(value)(walk(v, leaf) for v in value)
    if isinstance(value, dict):
        out = copy.copy(value)
        for key, item in value.items():
            out[key] = walk(item, leaf)
        return out
    return leaf(value)


def _onto(device: Any, value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        moved = value.detach().to(device)
        if isinstance(value, torch.nn.Parameter):
            return torch.nn.Parameter(moved, requires_grad=value.requires_grad)
        return moved.requires_grad_(value.requires_grad)
    if isinstance(value, torch.nn.Module):
        return value.to(device)
    return value
