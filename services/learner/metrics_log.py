"""The learner's per-update record: metrics.jsonl and TensorBoard, written by rank 0, plus a terminal
progress bar. (Logging itself, the text or JSON lines every process writes, is services/shell/logs.py.)"""

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

    def write(self, step: int, record: dict, advance: bool = True) -> dict:
        """One record (answered as written). `advance=False` for records that are not an update
        of their own: the progress bar does not move."""
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
        return record

    def rewind(self, step: int, record: dict | None = None) -> None:
        """Make the log end at update `step`, where a resumed learner continues: records of updates
        after it (trained after the checkpoint, lost with the crash, trained again now) are
        dropped, and `record`, the checkpoint's copy of update `step`'s own, is added when the
        crash came before it was written. Steps stay contiguous and each appears once."""
        self._file.close()
        kept = []
        for line in self.path.read_text().splitlines() if self.path.is_file() else []:
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by the crash
        if record is not None and (not kept or json.loads(kept[-1])["step"] < step):
            kept.append(json.dumps(record))
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.path)
        self._file = self.path.open("a", buffering=1)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
