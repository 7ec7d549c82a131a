"""Per-update metrics: JSON lines and TensorBoard, written by rank 0, plus a terminal progress bar."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

# Shown beside the progress bar: the newest value of each.
_SHOWN = ("reward_mean", "clip_fraction", "tokens_per_s")


class MetricsLog:
    def __init__(self, log_dir: Path, total: int | None = None, tensorboard: bool = True) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / "metrics.jsonl"
        self._file = self.path.open("a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(log_dir / "tb"))
        self._bar = None
        self._shown: dict[str, float] = {}
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="update", dynamic_ncols=True)

    def write(self, step: int, record: dict, advance: bool = True) -> None:
        """One record. `advance=False` for records that are not an update of their own (an
        evaluation logged at the update it scored): the progress bar does not move."""
        record = {"step": step, "time": time.time(), **record}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and key not in ("step", "time"):
                    self._tb.add_scalar(key, value, step)
        if self._bar is not None:
            if advance:
                self._bar.update(1)
            self._shown.update({k: record[k] for k in _SHOWN if k in record})
            self._bar.set_postfix({k.split("/", 1)[-1]: f"{v:.3g}" for k, v in self._shown.items()})

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
