from rlctl.sinks import JsonlSink, MultiSink, NullSink, Sink, read_jsonl


class Broken:
    name = "broken"

    def __init__(self, method="log"):
        self.method = method
        self.calls = 0
        self.closed = False

    def log(self, metrics, step):
        self.calls += 1
        if self.method == "log":
            raise RuntimeError("disk on fire\nsecond line of detail")

    def summary(self, values):
        if self.method == "summary":
            raise ValueError("bad summary")

    def close(self):
        self.closed = True
        if self.method == "close":
            raise OSError("cannot close")


class Recorder:
    name = "recorder"

    def __init__(self):
        self.rows, self.summaries, self.closed = [], [], 0

    def log(self, metrics, step):
        self.rows.append((step, dict(metrics)))

    def summary(self, values):
        self.summaries.append(dict(values))

    def close(self):
        self.closed += 1


def test_sinks_satisfy_protocol(tmp_path):
    assert isinstance(NullSink(), Sink)
    assert isinstance(MultiSink([]), Sink)
    jsonl = JsonlSink(tmp_path / "m.jsonl")
    assert isinstance(jsonl, Sink)
    jsonl.close()


def test_null_sink_accepts_everything():
    sink = NullSink()
    sink.log({"reward/mean": 1.0}, step=3)
    sink.summary({"final/x": 1})
    sink.close()


def test_failing_sink_warns_once_and_training_continues(tmp_path, capsys):
    broken, recorder = Broken(), Recorder()
    jsonl = JsonlSink(tmp_path / "metrics.jsonl")
    sink = MultiSink([broken, recorder, jsonl])
    for step in range(1, 6):
        sink.log({"reward/mean": step / 10}, step=step)
    sink.summary({"final/reward": 0.5})
    sink.close()

    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err_lines) == 1, err_lines
    assert "broken" in err_lines[0] and "RuntimeError" in err_lines[0]
    assert "disk on fire" in err_lines[0] and "second line" not in err_lines[0]
    assert broken.calls == 1  # disabled after the first failure
    assert broken.closed  # released when disabled
    assert [s for s, _ in recorder.rows] == [1, 2, 3, 4, 5]
    assert recorder.summaries == [{"final/reward": 0.5}] and recorder.closed == 1
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert list(sink.failed) == ["broken"]


def test_failures_in_summary_and_close_are_contained(capsys):
    recorder = Recorder()
    sink = MultiSink([Broken("summary"), Broken("close"), recorder])
    sink.log({"a": 1.0}, step=1)
    sink.summary({"x": 1})
    sink.close()
    sink.close()  # idempotent
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 2
    assert "summary()" in err[0] and "bad summary" in err[0]
    assert "close()" in err[1] and "cannot close" in err[1]
    assert recorder.closed == 1 and recorder.summaries == [{"x": 1}]
