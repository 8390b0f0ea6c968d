"""How the learner runs and how ranks talk: the ``Backend`` interface and its registry.

``build_backend(hardware.backend, ...)`` looks the name up in ``BACKENDS``: ``torch``
(plain torch, ``base.py``) and ``deepspeed`` (ZeRO 0-3, ``deepspeed_backend.py``, which
imports ``deepspeed`` only when it is used). Importing this package registers both;
``launch.py`` starts ranks through torchrun's launcher, ``tcp_group.py`` joins the group
a launcher describes.
"""
from rlctl.backends.base import (BACKENDS, Backend, TorchBackend, build_backend, dist_env,
                                 register_backend)
from rlctl.backends import deepspeed_backend  # noqa: F401  (registers "deepspeed")

__all__ = ["BACKENDS", "Backend", "TorchBackend", "build_backend", "dist_env",
           "register_backend"]
