"""The Trainer decides prompt sharing from its own backend, not from how the source was built."""
from omegaconf import OmegaConf

from rlctl.dist.backends import TorchBackend
from rlctl.config.compose import compose
from rlctl.train.trainer import Trainer
from rlctl.models.loading import load_model_and_tokenizer
from rlctl.train.build import prepare_task
from rlctl.train.sources import build_source
from rlctl.sinks import NullSink


def _trainer(backend):
    cfg = compose(["trainer.prompts_per_step=2", "algo.group_size=2", "trainer.eval_every=0",
                   "trainer.share_prompts=true"]).cfg
    OmegaConf.resolve(cfg)
    model, tok = load_model_and_tokenizer("tiny", **{k: v for k, v in dict(cfg.model).items() if k != "name"})
    task = prepare_task(cfg, tok, model, quiet=True)   # as rlctl train prepares it
    source = build_source(cfg, model, tok, task)          # built without a backend: sharing on
    return Trainer.from_config(cfg, model, tok, task, NullSink(), source=source, backend=backend)


def test_multi_rank_zero3_backend_turns_learner_prompt_sharing_off():
    """Multi-rank ZeRO-3 needs every rank to run the same forwards, so sharing is off
    there even when the source (built without a backend, as tests and bench do) shares."""
    zero3 = TorchBackend("cpu")
    zero3.zero_stage, zero3.world_size, zero3.lockstep = 3, 2, True   # as a 2-rank ZeRO-3 backend reports
    tr = _trainer(zero3)
    try:
        assert tr.source.share_prompts is True and tr.update_settings.share_prompts is False
    finally:
        tr.close()
    tr = _trainer(TorchBackend("cpu"))                     # one rank: sharing as configured
    try:
        assert tr.update_settings.share_prompts is True
    finally:
        tr.close()
