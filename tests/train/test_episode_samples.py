"""Sample-table pieces of episodes (rlctl/train/metrics.py, rlctl/sinks/sink.py): which
tasks offer tools (the episode player asks a fresh environment), and a list of turns written as one cell."""
from rlctl.config.compose import compose
from rlctl.demo.tiny import build_tokenizer
from rlctl.rollout.episodes.loop import EpisodePlayer
from rlctl.train.build import task_from_config
from rlctl.sinks.sink import cell_text


def _tool_task(*overrides) -> bool:
    cfg = compose(list(overrides)).cfg
    return EpisodePlayer(build_tokenizer(), task_from_config(cfg).task, cfg.rollout, 2, (0,)).tool_task


def test_only_a_task_whose_environment_has_tools_offers_them():
    assert _tool_task("task=calculator", "task.num_eval=4")
    assert not _tool_task("task=calculator", "task.use_tools=false", "task.num_eval=4")  # no-tool ablation
    assert not _tool_task("task=guess_number")


def test_turns_are_one_cell_with_roles_and_cut_observations_marked():
    turns = [{"role": "model", "text": "8", "reward": 0.0, "truncated": False},
             {"role": "observation", "text": "higher", "reward": 0.0, "truncated": True},
             {"role": "model", "text": "1 2", "reward": 1.0, "truncated": False}]
    assert cell_text(turns) == "model: 8 | observation: higher [truncated] | model: 1 2"
    assert cell_text([1, 2]) == "[1, 2]"                          # other lists as before
