"""`rlctl eval`, `rlctl rollout` and `rlctl inspect`: the commands around `rlctl train`.

    app.py          the Typer commands (light imports only: `rlctl --help` stays instant)
    targets.py      TARGET resolution (run dir | model dir | LoRA adapter | none) -> config,
                    model, task; shared by eval and rollout
    files.py        run-dir test and atomic JSON writes (light: inspect uses them)
    passk.py        the unbiased pass@k estimator (Chen et al. 2021)
    eval_cmd.py     `rlctl eval`: greedy vs sampled held-out metrics, every reward design
    rollout_cmd.py  `rlctl rollout`: scored completions with learner log-probs -> JSONL
    inspect_cmd.py  `rlctl inspect`: run dirs (config diff, metric summary, plots)
    audit.py        `rlctl inspect FILE.jsonl`: rollout audit (EOS/mask, reward hacking)
    audit_print.py  the audit report as tables
    plots.py        matplotlib (Agg) curves for inspect
    fmt.py          flattening and cell formatting for the tables
"""
from rlctl.commands.app import register

__all__ = ["register"]
