"""Bad input, as a user types it: every case gets one line that names what is wrong
(and what is valid), exit code 2, and no traceback."""
import shlex

import pytest
from typer.testing import CliRunner

from rlctl.cli import app

CASES = [
    ('algo.foo=1', "unknown config key 'algo.foo'"),
    ('algo.clip_eps=abc', "invalid value 'abc' for 'algo.clip_eps': expected a float (e.g. algo.clip_eps=0.1)"),
    ('seed=abc', "invalid value 'abc' for 'seed': expected an integer (e.g. seed=1)"),
    ('algo=nope', "unknown algo 'nope'; valid: cispo, dapo"),
    ('task=nope', "unknown task 'nope'; valid:"),
    ('model=nope', "unknown model 'nope'; valid: hf, tiny"),
    ('hardware=nope', "unknown hardware 'nope'; valid: cpu, deepspeed, fsdp2, gpu"),
    ('hardware.cpu_offload=true', 'hardware.cpu_offload=true needs hardware=fsdp2 (got hardware.backend=torch'),
    ('hardware=fsdp2 hardware.num_processes=2 trainer.micro_batch_tokens=256',
     'trainer.micro_batch_tokens with hardware=fsdp2 on several ranks'),
    ('hardware=fsdp2 model.lora.enabled=true model.lora.save_merged=true',
     'model.lora.save_merged=true with hardware=fsdp2'),
    ('logger=nope', "unknown logger 'nope'; valid: jsonl, none, tensorboard, wandb"),
    ('algo.loss_agg_mode=mean', 'valid: token-mean, seq-mean-token-mean'),
    ('algo.kl.estimator=k9', 'valid: k1, k2, k3'),
    ('algo.kl.placement=somewhere', 'valid: in_loss, in_reward'),
    ('algo.advantage=magic', "unknown advantage estimator 'magic'"),
    ('algo.policy_loss=magic', "unknown policy loss 'magic'"),
    ('trainer.lr=-1', "invalid trainer.lr '-1.0'; must be > 0"),
    ('trainer.steps=-5', "invalid trainer.steps '-5'; must be >= 0"),
    ('algo.minibatches=3', 'must divide the 64 sequences per step'),
    ('hardware.num_processes=3', 'hardware.num_processes=3 must be >= 1 and divide trainer.prompts_per_step=8'),
    ('hardware.num_processes=16', 'hardware.num_processes=16 must be >= 1 and divide'),
    ('hardware.zero_stage=5', "invalid hardware.zero_stage '5'; valid: 0, 1, 2, 3"),
    ('hardware.deepspeed_config=/nonexistent/ds.json', "no such file '/nonexistent/ds.json'"),
    ('model=hf', 'model=hf needs model.name_or_path'),
    ('model=hf model.name_or_path=/nonexistent/model', 'cannot load model'),
    ('model.dtype=float64', 'valid: float32, bfloat16'),
    ('algo.critic=shared', 'trains a value model that algo.advantage=grpo does not use'),
    ('algo=ppo algo.critic=none', 'algo.advantage=gae needs a critic'),
    ('algo.vf_coef=0.3', 'algo.vf_coef is a critic setting, and algo=grpo has no critic'),
    ('algo.clip_ratio_c=0.5', 'dual clip needs a value > 1'),
    ('algo.kl.target=0.1', 'an adaptive KL (algo.kl.target) needs algo.kl.coef > 0'),
    ('algo.gamma=1.5', "invalid algo.gamma '1.5'; must be in [0, 1] and finite"),
    ('rollout.temperature=0', 'sampling needs > 0'),
    ('trainer.async_rollout.num_actors=-1', "invalid trainer.async_rollout.num_actors '-1'; must be >= 1"),
    ('trainer.async_rollout.enabled=true hardware.nnodes=2', 'rollout on other machines is rollout.engine=server'),
    ('rollout.engine=server hardware.num_processes=2', 'rollout.engine=server runs one learner process'),
    ('trainer.async_rollout.max_staleness=-1', "invalid trainer.async_rollout.max_staleness '-1'; must be >= 0"),
    ('trainer.async_rollout.enabled=true hardware.num_processes=2', 'it needs hardware.num_processes=1'),
    ('task.reward=bogus', 'valid: exact, positional, inclusion_order'),
    ('task.num_digits=0', "invalid task.num_digits '0'; must be >= 1"),
    ('logger.wandb_mode=sometimes', 'valid: offline, online, disabled'),
    ('run.output_dir=/proc/forbidden', "cannot write the run directory under '/proc/forbidden'"),
    ('--recipe /nonexistent/recipe.yaml', "cannot read recipe '/nonexistent/recipe.yaml'"),
    ('--recipe no-such-recipe', 'recipes: agg-seq-mean-token-mean'),
    ('--recipe {bad_recipe}', 'expected a YAML mapping'),
    ('--recipe {target_recipe}', '_target_'),
    ('--resume /nonexistent/run', 'not a run directory'),
    ('--resume {tmp} --recipe grpo', 'cannot be combined with --recipe'),
    ('algo=dpo task=preferences task.pairs_from=sorting task.num_pairs=8 algo.mask_truncated=true', 'algo.loss_type=sigmoid needs algo.mask_truncated=false'),
    ('algo=dpo task=preferences task.pairs_from=sorting task.num_pairs=8 algo.kl.coef=0.1', 'algo.loss_type=sigmoid needs algo.kl.coef=0'),
    ('algo=dpo task=preferences task.pairs_from=sorting task.num_pairs=8 algo.entropy_coef=0.01', 'algo.loss_type=sigmoid needs algo.entropy_coef=0'),
    ('algo=dpo task=preferences task.pairs_from=sorting task.num_pairs=8 rollout.temperature=0.7', 'algo.loss_type=sigmoid needs rollout.temperature=1.0'),
    ('algo=dpo task=preferences task.pairs_from=sorting task.num_pairs=8 task.num_eval=1 hardware.num_processes=2',
     "task 'preferences' has 1 held-out rows for hardware.num_processes=2 ranks"),
    ('--bogus', "unknown option '--bogus'"),
    ('-m seed=0,1 --dry-run', '--dry-run plans one run from a config; it cannot be combined with -m'),
    ('algo.clip_eps', "cannot parse 'algo.clip_eps' (missing EQUAL at '<EOF>'); overrides look like key=value"),
]


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


@pytest.mark.parametrize("args, fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input(runner, tmp_path, args, fragment):
    bad = tmp_path / "bad.yaml"
    bad.write_text("just a string\n")
    target = tmp_path / "target.yaml"
    target.write_text("# @package _global_\n_target_: os.system\n")
    argv = shlex.split(args.format(bad_recipe=bad, target_recipe=target, tmp=tmp_path))
    result = runner.invoke(app, ["train", "trainer.steps=1", f"run.output_dir={tmp_path}/runs", *argv])
    assert result.exit_code == 2, (result.exit_code, result.output)
    err = result.stderr
    assert "Traceback" not in err
    assert isinstance(result.exception, SystemExit), result.exception
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment in lines[0], lines[0]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())   # nothing written


def test_debug_shows_the_traceback(runner, tmp_path):
    result = runner.invoke(app, ["train", "--debug", "algo.loss_agg_mode=mean", f"run.output_dir={tmp_path}"])
    assert result.exit_code != 0 and result.exception is not None
    assert "ConfigError" in type(result.exception).__name__
