"""How the learner steps and ranks talk: the ``Backend`` hierarchy (``base.py``) and the
start of ranks through torchrun's launcher (``launch.py``)."""
from rlctl.backends.base import (BACKENDS, Backend, TorchBackend, build_backend, dist_env,
                                 register_backend)

__all__ = ["BACKENDS", "Backend", "TorchBackend", "build_backend", "dist_env",
           "register_backend"]
