"""Weights & Biases sink that never hangs or crashes training: offline by default, falling
back to offline (one warning) when online fails, a no-op when offline fails; one history row
per step, a lower step left out with one warning."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from .sink import cell_text, table_columns

MODES = ("online", "offline", "disabled")


def sample_key(table: str, step: int) -> str:
    """The history key of one sample table, e.g. `samples/train/step_000025`."""
    return f"samples/{table}/step_{step:06d}"


def _warn(message: str) -> None:
    print(f"rlctl: warning: {message}", file=sys.stderr, flush=True)


def _plain(value: Any) -> Any:
    """A JSON-friendly copy of a config / summary value (tensors -> float, Paths -> str)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item"):
        with contextlib.suppress(Exception):
            return value.item()
    return json.loads(json.dumps(value, default=str))


def has_wandb_credentials(base_url: str | None = None) -> bool:
    """True when wandb would find an API key without prompting."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:  # wandb's own lookup, without its prompt (internal API: guarded)
        import wandb   # optional and slow to import: only when a W&B run is asked for
        from wandb.sdk.lib.wbauth import authenticate

        host = base_url or wandb.setup().settings.base_url
        return authenticate.authenticate_session(host=host, source="rlctl", prompt=False,
                                                 update_session=False) is not None
    except Exception:
        return False


class WandbSink:
    """Log to wandb; `mode` in use, `run_file` (None when disabled). close() tears wandb down and
    restores the environment; console="off" (wrapping stdout fights the live view)."""

    name = "wandb"
    ENV_DIRS = {"WANDB_DIR": "", "WANDB_CACHE_DIR": "wandb-cache",   # WANDB_DIR gets `wandb/`
                "WANDB_CONFIG_DIR": "wandb-config", "WANDB_DATA_DIR": "wandb-data"}

    def __init__(self, run_dir: str | Path, project: str, name: str | None,
                 run_config: Mapping[str, Any] | None, mode: str = "offline", *,
                 init_timeout: float = 30.0, finish_timeout: float = 60.0):
        if mode not in MODES:
            raise ValueError(f"wandb mode must be one of {MODES}, got {mode!r}")
        self.run_dir = Path(run_dir).resolve()
        self.mode = "disabled"
        self.init_seconds: float | None = None
        self.finish_seconds: float | None = None
        self._run: Any = None
        self.run_file: Path | None = None
        self._pending: tuple[int, dict[str, float]] | None = None
        self._last_step = -1  # last committed step
        self._warned_order = False
        self._saved_env: dict[str, str | None] = {}
        self._owns_setup = False
        self._closed = False
        if mode != "disabled":
            try:
                self._start(project, name, _plain(dict(run_config or {})), mode, init_timeout,
                            finish_timeout)
            except Exception as exc:  # e.g. an unwritable run_dir: never stop training
                _warn(f"wandb set-up failed ({type(exc).__name__}: {exc}); wandb logging disabled")
                self._run = None
                self.mode = "disabled"
                self._teardown()

    def _set_env(self, mode: str) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        dirs = {var: str(self.run_dir / sub) for var, sub in self.ENV_DIRS.items()
                if var != "WANDB_CONFIG_DIR" or mode != "online"}   # online: the user's settings
        for var, value in {"WANDB_SILENT": "true", **dirs}.items():
            self._saved_env.setdefault(var, os.environ.get(var))
            os.environ[var] = value  # wandb creates these folders when it needs them

    def _restore_env(self) -> None:
        for var, value in self._saved_env.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        self._saved_env.clear()

    def _start(self, project, name, run_config, mode, init_timeout, finish_timeout) -> None:
        self._set_env(mode)
        try:
            import wandb   # optional and slow to import: only when a W&B run is asked for
            from wandb.sdk import wandb_setup
        except Exception as exc:
            _warn(f"wandb unavailable ({type(exc).__name__}: {exc}); wandb logging disabled")
            self._restore_env()
            return
        self._owns_setup = getattr(wandb_setup, "_singleton", "unknown") is None

        problems: list[str] = []
        attempts = [mode] if mode == "offline" else ["online", "offline"]
        if mode == "online" and not has_wandb_credentials():
            problems.append("online: no API key configured (wandb login / WANDB_API_KEY)")
            attempts = ["offline"]
        for attempt in attempts:
            settings = wandb.Settings(  # x_disable_stats: no system-monitor thread
                x_disable_stats=True, console="off", x_save_requirements=False, save_code=False,
                disable_git=True, init_timeout=init_timeout, silent=True,
                finish_timeout=finish_timeout if attempt == "online" else 0.0)
            start = time.perf_counter()
            try:
                self._run = wandb.init(project=project, name=name, config=run_config,
                                       dir=str(self.run_dir), mode=attempt, settings=settings)
            except Exception as exc:
                first = (str(exc).splitlines() or [""])[0]
                problems.append(f"{attempt}: {type(exc).__name__}: {first}")
                continue
            self.init_seconds = time.perf_counter() - start
            if getattr(self._run, "disabled", False):  # a no-op run: nothing is written
                self.mode = "disabled"
            else:
                self.mode = attempt
                self.run_file = Path(self._run.settings.sync_file)
            break

        if self._run is None:
            _warn(f"wandb init failed ({'; '.join(problems)}); wandb logging disabled")
            self._teardown()
        elif problems:
            _warn(f"wandb {'; '.join(problems)}; logging offline to {self.run_file}")

    def _commit(self) -> None:
        if self._pending is None or self._run is None:
            return
        step, row = self._pending
        self._pending = None
        self._run.log(row, step=step, commit=True)
        self._last_step = step

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._run is None:
            return
        self._add({str(k): float(v) for k, v in metrics.items()}, int(step))

    def samples(self, rows: Sequence[Mapping[str, Any]], step: int, table: str = "train") -> None:
        """One wandb.Table per call, under its own key (``sample_key``)."""
        if self._run is None or not rows:
            return
        import wandb   # already imported by _start (the run exists)

        columns = table_columns(rows)
        data = [[cell_text(v) if isinstance(v, list) else _plain(v)    # turns: one text
                 for v in map(row.get, columns)] for row in rows]
        key = sample_key(table, int(step))
        self._add({key: wandb.Table(columns=columns, data=data, allow_mixed_types=True)}, int(step))

    def _add(self, row: dict[str, Any], step: int) -> None:
        """Buffer `row` into the history row of `step`, committed when a higher step comes and
        before summary() and close()."""
        if self._pending is not None and step == self._pending[0]:
            self._pending[1].update(row)
            return
        if step <= self._last_step or (self._pending is not None and step < self._pending[0]):
            if not self._warned_order:
                self._warned_order = True
                _warn(f"wandb keeps steps in increasing order only: step {step} came after "
                      f"step {max(self._last_step, self._pending[0] if self._pending else -1)}"
                      "; such rows are left out of wandb (they stay in the JSONL)")
            return
        self._commit()
        self._pending = (step, row)

    def summary(self, values: Mapping[str, Any]) -> None:
        if self._run is None:
            return
        self._commit()  # else the last row's late auto-summary would overwrite these
        self._run.summary.update(_plain(dict(values)))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._run is not None:
                try:
                    self._commit()
                finally:
                    start = time.perf_counter()
                    self._run.finish()
                    self.finish_seconds = time.perf_counter() - start
        finally:
            self._run = None
            self._teardown()

    def _teardown(self) -> None:
        try:
            if self._owns_setup:
                import wandb   # optional: imported (and set up) by _start already

                wandb.teardown()
        except Exception:
            pass
        finally:
            self._owns_setup = False
            self._restore_env()
