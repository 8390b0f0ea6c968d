"""`rlctl eval`, `rlctl rollout` and `rlctl inspect`: the commands around `rlctl train`.

    app.py          the Typer commands (light imports only: `rlctl --help` stays instant)
    targets.py      TARGET resolution (run dir | model dir | LoRA adapter | none) -> config,
                    model, task; shared by eval and rollout
    files.py        run-dir test and atomic JSON writes (light: inspect uses them)
    passk.py        the unbiased pass@k estimator (Chen et al. 2021)
    eval_cmd.py     `rlctl eval`: greedy vs sampled held-out metrics, every reward design
    rollout_cmd.py  `rlctl rollout`: scored completions with learner log-probs -> JSONL
    inspect_cmd.py  `rlctl inspect`: PATH arguments -> one run, runs compared, or the audit
    run_record.py   a run dir read back: config, overrides, metric rows, its defaults
    inspect_report.py  one run vs its defaults, several runs side by side (config, metrics, plots)
    inspect_print.py   those reports as tables
    audit.py        `rlctl inspect FILE.jsonl`: statistics, reward-hacking signs, samples
    audit_rows.py   the rollout file read into columns (the checks applied on the way)
    audit_checks.py the EOS/mask alignment checks, row by row
    audit_print.py  the audit report as tables
    plots.py        matplotlib (Agg) curves for inspect
    fmt.py          flattening and cell formatting for the tables
"""
from rlctl.commands.app import register

__all__ = ["register"]
