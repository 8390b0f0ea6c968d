"""How the learner steps and ranks talk: the ``Backend`` hierarchy and the rank launcher."""
from rlctl.dist.backends import BACKENDS, TorchBackend, build_backend, register_backend

__all__ = ["BACKENDS", "TorchBackend", "build_backend", "register_backend"]
