"""weight_sync=disk shares ``weight_dir`` with whoever else writes there: rlctl prunes and
overwrites only the version directories it recorded in the directory's manifest."""
import pytest
import torch

from rlctl.errors import UserError
from rlctl.rollout.engines.engine_source import _write
from rlctl.rollout.engines.kinds import SGLangKind

W = {"w": torch.zeros(2)}


def test_disk_pushes_prune_only_the_versions_rlctl_wrote(tmp_path):
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "user_note.txt").write_text("mine")          # a user's, not rlctl's
    for version in range(2, 6):
        _write(str(tmp_path), version, [(W, "full")])
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert names == ["v1", "v4", "v5"]                                # v2, v3: rlctl's, pruned
    assert (tmp_path / "v1" / "user_note.txt").read_text() == "mine"


def test_a_version_directory_rlctl_did_not_write_is_never_overwritten(tmp_path):
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "user_note.txt").write_text("mine")
    with pytest.raises(UserError, match=r"v1.*not written by rlctl.*weight_dir"):
        _write(str(tmp_path), 1, [(W, "full")])
    assert (tmp_path / "v1" / "user_note.txt").read_text() == "mine"
    _write(str(tmp_path), 2, [(W, "full")])
    _write(str(tmp_path), 2, [(W, "full")])                               # its own: rewritten


def test_sglang_full_pushes_keep_a_users_rlctl_named_directory(tmp_path):
    (tmp_path / "rlctl-v1").mkdir()
    (tmp_path / "rlctl-v1" / "note").write_text("mine")
    kind = SGLangKind(weights_dir=str(tmp_path))
    for version in range(2, 5):
        kind.push(version, W, "full")
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "rlctl-v1", "rlctl-v3", "rlctl-v4"]
