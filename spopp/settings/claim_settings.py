"""The claim settings shared by every service that claims a device or slot at start-up (replicas,
the evaluator): one definition, so both read the same names (SPOPP_<SERVICE>_CLAIM_DIR, ...) with
the same bounds and checks. The claim itself is spopp/machine/claim.py."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from spopp.machine.claim import devices_setting
from spopp.settings.base import SettingsGroup


class ClaimSettings(SettingsGroup):
    claim_dir: Path | None = Field(
        None,
        description="folder shared by the processes of a node or cluster (a volume) where this one claims "
        "a free device, or without devices a numbered slot, at start-up and takes its worker id and port "
        "from it; unset: no claim, worker id and port as configured",
    )
    devices: str | None = Field(
        None,
        description="GPUs to claim from (needs claim_dir; every role shares the device locks): auto "
        "(nvidia-smi), a list 0,1,2 or a range 2-5; the claimed one becomes CUDA_VISIBLE_DEVICES "
        "(cuda:0); unset: claim a numbered slot",
    )
    claim_ports: bool = Field(
        True,
        description="with a claim, listen on port + the claim's index, so processes sharing one host "
        "network never collide (off for pods with a network of their own)",
    )
    claim_record: Path | None = Field(
        None,
        description="write this process's worker id, port and pid (and its claim, with claim_dir) here "
        "as JSON at start-up, for a health check to find its port: /tmp/spopp-claim.json",
    )
    claim_wait_seconds: float = Field(
        0.0, ge=0, le=86_400, description="wait this long for a free claim before giving up"
    )

    @field_validator("devices", mode="before")
    @classmethod
    def _devices_parse(cls, value: object) -> object:
        return devices_setting(value)  # a bad list stops the start here, naming the field

    @model_validator(mode="after")
    def _devices_need_a_claim(self):
        if self.devices and self.claim_dir is None:
            raise ValueError("devices are claimed in claim_dir: set claim_dir too")
        return self
