"""The torchvision import fix of the CPU layer (bana_sglang.compat).

torchvision from PyPI beside the CPU torch 2.13 build fails at import with
``operator torchvision::nms does not exist``: its compiled ops do not load, yet
``_meta_registrations`` registers fake kernels for ``torchvision::nms``/``qnms``.
:func:`install` adds a lazy import hook that defines those two op schemas (with
a plain-torch CPU ``nms``) right before that module runs; it costs nothing in a
process that never imports torchvision. Stdlib-only at import time: it runs
from ``sitecustomize`` at interpreter start-up.
"""

import importlib.abc
import sys

_TARGET = "torchvision._meta_registrations"
_LIB = None  # the torch.library.Library must outlive the import


def _define_torchvision_ops() -> None:
    import torch

    try:
        torch.ops.torchvision.nms  # noqa: B018 (raises unless the compiled ops loaded)
        return
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

    def nms_cpu(dets, scores, iou_threshold):
        order = torch.argsort(scores, descending=True)
        x1, y1, x2, y2 = dets.unbind(1)
        areas = (x2 - x1) * (y2 - y1)
        keep = []
        suppressed = torch.zeros(dets.shape[0], dtype=torch.bool)
        for i in order.tolist():
            if suppressed[i]:
                continue
            keep.append(i)
            w = (torch.minimum(x2[i], x2) - torch.maximum(x1[i], x1)).clamp(min=0)
            h = (torch.minimum(y2[i], y2) - torch.maximum(y1[i], y1)).clamp(min=0)
            inter = w * h
            suppressed |= inter / (areas[i] + areas - inter) > iou_threshold
        return torch.tensor(keep, dtype=torch.long)

    lib.impl("nms", nms_cpu, "CPU")
    # Keep the library object alive for the life of the process.
    global _LIB
    _LIB = lib


class _TorchvisionOpsFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == _TARGET:
            sys.meta_path.remove(self)
            _define_torchvision_ops()
        return None  # let the normal finders import the module


def install() -> None:
    """Idempotent; a no-op once torchvision is imported."""
    if _TARGET in sys.modules:
        return
    if not any(isinstance(f, _TorchvisionOpsFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionOpsFinder())
