"""Image classification (the seed's vision study): :class:`VisionTask` (:mod:`.task`) over the vision
data (:mod:`.data`: :mod:`.splits` and :mod:`.decoded` -> :mod:`.partition` -> :mod:`.tensors` ->
:mod:`.batches`, with :mod:`.cache` keeping what they derive on disk) and the vision models
(:mod:`.models`).

``fedact_app.tasks.vision:VisionTask`` is the task registry's name for the class.
"""

from fedact_app.compat import ensure_torchvision_ops

# Before any module of this package imports ``datasets``, which may import torchvision: keep that
# importable on the CPU torch.
ensure_torchvision_ops()

from fedact_app.tasks.vision.task import VisionTask  # noqa: E402

__all__ = ["VisionTask"]
