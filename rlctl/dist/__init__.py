"""How the learner steps and ranks talk: the ``Backend`` hierarchy (``backends.py``) and the
start of ranks through torchrun's launcher (``launch.py``)."""
from rlctl.dist.backends import (BACKENDS, Backend, TorchBackend, build_backend, dist_env,
                                 register_backend)

__all__ = ["BACKENDS", "Backend", "TorchBackend", "build_backend", "dist_env",
           "register_backend"]
