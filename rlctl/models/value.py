"""The PPO critic: a float32 value head on the policy's backbone or on a copy of it."""
from __future__ import annotations

import copy
import os
from typing import NamedTuple

import torch
from safetensors.torch import save_file
from torch import nn

from rlctl.models.kv_share import cache_of

VALUE_HEAD_FILE = "value_head.safetensors"


class ValueHead(nn.Module):
    """Linear(hidden_size, 1): hidden states [..., H] -> values [...] (float32)."""

    def __init__(self, hidden_size: int, init_std: float = 0.0, device=None):
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1, device=device, dtype=torch.float32)
        if init_std > 0:
            nn.init.normal_(self.summary.weight, std=init_std)
        else:
            nn.init.zeros_(self.summary.weight)
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.summary(hidden.to(self.summary.weight.dtype)).squeeze(-1)

    def save(self, directory, state_dict=None) -> None:
        os.makedirs(directory, exist_ok=True)
        state = self.state_dict() if state_dict is None else state_dict
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()},
                  os.path.join(directory, VALUE_HEAD_FILE))


def _part(state_dict, prefix: str):
    """The entries of ``state_dict`` under ``prefix``, the prefix cut (None stays None)."""
    return None if state_dict is None else \
        {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}


def _hidden_size(model) -> int:
    config = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    return int(config.hidden_size)


def _device(model) -> torch.device:
    return next(model.parameters()).device


class PolicyValueOutput(NamedTuple):
    logits: torch.Tensor  # [N, L, V]
    values: torch.Tensor  # [N, L], float32
    cache: object = None  # the policy's key/value cache, when asked for (use_cache=True)
    hidden: object = None  # [N, L, H] the final-normed hidden state the LM head reads


class PolicyValueModel(nn.Module):
    """A causal LM (``self.policy``) plus a value head on its backbone: a drop-in for the policy."""

    def __init__(self, policy, init_std: float = 0.0):
        super().__init__()
        self.policy = policy
        self.value_head = ValueHead(_hidden_size(policy), init_std, device=_device(policy))
        self.detach_backbone = False

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False,
                **kwargs) -> PolicyValueOutput:
        """``kwargs`` go to the policy (e.g. ``logits_to_keep=1``)."""
        kwargs.pop("output_hidden_states", None)     # always on: the values need them
        out = self.policy(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids, use_cache=use_cache,
                          output_hidden_states=True, **kwargs)
        hidden = out.hidden_states[-1]                                    # [N, L, H]
        v_in = hidden.detach() if self.detach_backbone else hidden   # critic warm-up: head only
        return PolicyValueOutput(out.logits, self.value_head(v_in),
                                 cache_of(out) if use_cache else None, hidden)

    def generate(self, *args, **kwargs):
        return self.policy.generate(*args, **kwargs)

    @property
    def config(self):
        return self.policy.config

    @property
    def generation_config(self):
        return self.policy.generation_config

    @property
    def dtype(self) -> torch.dtype:
        return self.policy.dtype

    @property
    def device(self) -> torch.device:
        return _device(self.policy)

    def save_pretrained(self, directory, state_dict=None, **kwargs) -> None:
        """The policy in HF format (an adapter for peft) plus ``value_head.safetensors``
        (``state_dict``: the weights to write, else the modules' own)."""
        self.policy.save_pretrained(directory, state_dict=_part(state_dict, "policy."), **kwargs)
        self.value_head.save(directory, _part(state_dict, "value_head."))


def _backbone_copy(policy):
    """A deep copy of ``policy``'s base model (no LM head); peft adapters merged in."""
    if hasattr(policy, "merge_and_unload"):             # a PeftModel
        return copy.deepcopy(policy).merge_and_unload().get_decoder()
    if hasattr(policy, "get_decoder"):
        return copy.deepcopy(policy.get_decoder())
    return copy.deepcopy(policy.base_model)


class SeparateCritic(nn.Module):
    """A trainable copy of the policy's backbone plus a value head; no weights shared."""

    def __init__(self, policy=None, init_std: float = 0.0, backbone=None):
        super().__init__()
        if (policy is None) == (backbone is None):
            raise ValueError("SeparateCritic needs exactly one of policy or backbone")
        self.backbone = _backbone_copy(policy) if backbone is None else backbone
        self.backbone.requires_grad_(True)
        self.value_head = ValueHead(_hidden_size(self.backbone), init_std,
                                    device=_device(self.backbone))

    def forward(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        """Values [N, L] (float32) from the backbone's final hidden state."""
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids, use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return self.value_head(hidden)

    def save_pretrained(self, directory, state_dict=None, **kwargs) -> None:
        self.backbone.save_pretrained(directory, state_dict=_part(state_dict, "backbone."), **kwargs)
        self.value_head.save(directory, _part(state_dict, "value_head."))

    @classmethod
    def from_sequence_classifier(cls, classifier) -> "SeparateCritic":
        """A critic from a one-label reward model's backbone and score head (InstructGPT)."""
        head = getattr(classifier, "score", None) or getattr(classifier, "classifier", None)
        if not isinstance(head, nn.Linear) or head.out_features != 1:
            raise ValueError(f"{type(classifier).__name__} has no one-output linear score head")
        critic = cls(backbone=copy.deepcopy(getattr(classifier, classifier.base_model_prefix)))
        with torch.no_grad():
            critic.value_head.summary.weight.copy_(head.weight.float())
            if head.bias is not None:
                critic.value_head.summary.bias.copy_(head.bias.float())
        return critic
