"""A damaged line of samples.jsonl is skipped by `rlctl inspect --samples`, and said once:
one line naming the file, the line numbers and how many; the other rows are shown."""
import json


def _row(step, group, length):
    return {"table": "train", "step": step, "group": group, "prompt": "3 1 2 =", "completion": "1 2 3",
            "reward": length / 10, "advantage": 0.0, "length": length, "finish_reason": "stop"}


def test_damaged_lines_are_skipped_and_said_once(cli, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    lines = [json.dumps(_row(1, g, n)) for g, n in ((0, 3), (0, 5), (1, 4), (1, 6))]
    lines.insert(2, '{"table": "train", "step": 1, "gro')                      # line 3: damaged
    lines.insert(4, '[1, 2]')                                                   # line 5: not a row
    (run / "samples.jsonl").write_text("\n".join(lines) + "\n" + '{"table": "tr')   # line 7: torn
    res = cli("inspect", run, "--samples", "--json", tmp_path / "s.json")
    assert res.exit_code == 0, res.output
    warnings = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert warnings == [f"rlctl: warning: {run / 'samples.jsonl'}: 3 of 7 lines skipped, not sample "
                        "rows (lines 3, 5, 7); the other 4 rows are shown"], res.stderr
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["audit"]["rows"] == 4 and report["skipped_lines"] == [3, 5, 7]


def test_a_whole_file_says_nothing(cli, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    (run / "samples.jsonl").write_text("".join(json.dumps(_row(1, 0, n)) + "\n" for n in (3, 5)))
    res = cli("inspect", run, "--samples")
    assert res.exit_code == 0 and res.stderr.strip() == "", res.stderr
