"""How the learner steps and ranks talk: the ``Backend`` hierarchy (``backends.py``) and the
start of ranks through torchrun's launcher (``launch.py``)."""
from rlctl.dist.backends import BACKENDS, TorchBackend, build_backend, register_backend

__all__ = ["BACKENDS", "TorchBackend", "build_backend", "register_backend"]
