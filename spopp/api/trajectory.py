"""The trajectory record a rollout replica POSTs to the learner, validated on arrival.

One flat token sequence per episode: `action_mask` is 1 exactly on tokens the policy generated
and `rollout_logprobs` holds the engine's log-probs there (0.0 elsewhere), so the learner can
recompute its own log-probs on the same positions and form importance weights. Under bounded
staleness a replica may swap weights between the turns of an episode; `token_versions` then says
which policy version generated each token, so the learner corrects exactly the stale ones. Position 0 is
never an action token: it has no prefix to be predicted from, so no loss can train on it.

The record checks what holds for every learner; what depends on the model (vocabulary, context)
or the recipe is checked at the learner's door (services.learner.ingest.IntakeLimits). Each
check names its field, so a refusal tells the sender which part of the record is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from spopp.api.tracker_api import MAX_VERSION
from spopp.settings.fields import Id

MAX_TOKENS = 1 << 20
# Token ids fit an int32 (what an embedding is indexed with); the learner's own check is the model's
# vocabulary (services.learner.ingest.IntakeLimits), this bound holds where none is given.
MAX_TOKEN_ID = 2**31 - 1
MAX_TIMINGS = 64
# Segments of one agent episode (a new one each time the agent rewrites its history); an episode
# makes at most this many calls anyway (the agent's max_calls is at most 10,000, rarely near).
MAX_SEGMENTS = 10_000
# The largest float32, exactly (a float64 can hold it). The learner trains in float32 (every
# float of a record that becomes a tensor is cast to it: log-probs, advantages, rewards, values),
# and a float64 beyond this is finite on the wire but +-inf there: rollout_logprobs = -1e308
# passed allow_inf_nan and became -inf in the loss, which stopped the learner at its first update.
FLOAT32_MAX = 3.4028234663852886e38
MAX_LABEL_CHARS = 64
# The learner's intake routes (rank 0): one record, and many in one call.
INTAKE = "/v1/trajectories"
INTAKE_BATCH = INTAKE + "/batch"
# Trajectories per POST /v1/trajectories/batch at most; the body limit bounds it too.
MAX_TRAJECTORIES_PER_CALL = 256


def count_action_tokens(action_mask: Sequence[int]) -> int:
    """THE count of action tokens: positions >= 1 whose mask is 1, those the loss trains on.

    Normalisation (token-weighted advantages) and the loss's token count both use it, so they
    cannot disagree. A Trajectory never sets position 0; a mask that does (an unvalidated
    trajectory-like object) has it ignored, as the loss ignores it.
    """
    return int(sum(action_mask[1:]))


class Trajectory(BaseModel):
    # As the tracker's bodies (spopp.api.tracker_api._Body): unknown fields refused, strict types (JSON's
    # true is no token id or count, "0.5" no reward, 1.0 no integer; an integer is a float).
    model_config = ConfigDict(extra="forbid", strict=True)

    run: Id
    request_id: Id
    task_id: Id
    policy_version: int = Field(ge=0, le=MAX_VERSION)
    # Field order matters: the mask and log-prob validators read the fields validated before them.
    token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] = Field(min_length=1, max_length=MAX_TOKENS)
    # Every list is capped (checked before its items): a reply never grows with a long bad list.
    action_mask: list[Annotated[int, Field(ge=0, le=1)]] = Field(max_length=MAX_TOKENS)
    rollout_logprobs: list[Annotated[float, Field(allow_inf_nan=False)]] = Field(max_length=MAX_TOKENS)
    # The policy version that generated each token, where a swap fell inside the episode (bounded
    # staleness): same length as token_ids, each >= policy_version (the dispatch's). None: every
    # token is of policy_version.
    token_versions: list[Annotated[int, Field(ge=0, le=MAX_VERSION)]] | None = Field(
        None, max_length=MAX_TOKENS
    )
    # Where each segment of an agent's episode starts (runtime.agent_session: the agent rewrote
    # its history, so the next call is a sequence of its own). None: one segment.
    segment_starts: list[Annotated[int, Field(ge=0, le=MAX_TOKENS)]] | None = Field(
        None, max_length=MAX_SEGMENTS
    )
    # reward, value and advantage become float32 tensors too: their bounds keep them far inside
    # float32's range (FLOAT32_MAX), so no value of theirs that passes can be infinite there.
    # timings never become tensors.
    reward: float = Field(ge=0.0, le=1.0, allow_inf_nan=False)
    value: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    # reward - value with both in [0, 1]; anything outside is a broken sender, not a big signal.
    advantage: float | None = Field(None, ge=-1.0, le=1.0, allow_inf_nan=False)
    num_turns: int = Field(ge=0, le=MAX_TOKENS)
    finish_reason: str = Field(max_length=MAX_LABEL_CHARS)
    # Seconds per phase: named by the sender (a key is cut like any field name in an error reply).
    timings: dict[
        Annotated[str, Field(max_length=MAX_LABEL_CHARS)], Annotated[float, Field(allow_inf_nan=False)]
    ] = Field(default_factory=dict, max_length=MAX_TIMINGS)

    @field_validator("action_mask")
    @classmethod
    def _mask_fits(cls, mask: list[int], info: ValidationInfo) -> list[int]:
        ids = info.data.get("token_ids")
        if ids is not None and len(mask) != len(ids):
            raise ValueError(
                f"token_ids, action_mask and rollout_logprobs must have one length; got "
                f"{len(ids)} token_ids and {len(mask)} action_mask"
            )
        if not any(mask):
            raise ValueError("action_mask has no generated token")
        if mask[0]:
            raise ValueError("action_mask[0] must be 0: position 0 has no prefix and is never trained on")
        return mask

    @field_validator("rollout_logprobs")
    @classmethod
    def _logprobs_fit(cls, logprobs: list[float], info: ValidationInfo) -> list[float]:
        ids, mask = info.data.get("token_ids"), info.data.get("action_mask")
        n = len(ids) if ids is not None else len(mask) if mask is not None else len(logprobs)
        if len(logprobs) != n:
            raise ValueError(
                f"token_ids, action_mask and rollout_logprobs must have one length; got "
                f"{n} token_ids and {len(logprobs)} rollout_logprobs"
            )
        # min and max run in C: a long valid list costs two passes, the loop below only a bad one.
        # Every position, not only action tokens: the whole list is cast to float32 on collation.
        if logprobs and (min(logprobs) < -FLOAT32_MAX or max(logprobs) > FLOAT32_MAX):
            i = next(i for i, lp in enumerate(logprobs) if not -FLOAT32_MAX <= lp <= FLOAT32_MAX)
            raise ValueError(
                f"rollout_logprobs[{i}] = {logprobs[i]!r} is outside float32's range "
                f"(+-{FLOAT32_MAX!r}), the dtype the learner trains in"
            )
        if mask is not None:
            for i, (m, lp) in enumerate(zip(mask, logprobs, strict=True)):
                if m and lp > 0.0:
                    raise ValueError(f"rollout_logprobs[{i}] = {lp!r} is not a log-probability (> 0)")
        return logprobs

    @field_validator("token_versions")
    @classmethod
    def _versions_fit(cls, versions: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if versions is None:
            return None
        ids, dispatched = info.data.get("token_ids"), info.data.get("policy_version")
        if ids is not None and len(versions) != len(ids):
            raise ValueError(f"token_versions has {len(versions)} entries for {len(ids)} token_ids")
        if dispatched is not None and versions and min(versions) < dispatched:
            i = next(i for i, v in enumerate(versions) if v < dispatched)
            raise ValueError(
                f"token_versions[{i}] = {versions[i]} is older than the dispatch's policy_version "
                f"{dispatched}: no token is generated before its request is dispatched"
            )
        return versions

    @field_validator("segment_starts")
    @classmethod
    def _segments_fit(cls, starts: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if starts is None:
            return None
        ids, mask = info.data.get("token_ids"), info.data.get("action_mask")
        if not starts or starts[0] != 0:
            raise ValueError("segment_starts must begin with 0")
        if any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
            raise ValueError("segment_starts must increase")
        if ids is not None and starts[-1] >= len(ids):
            raise ValueError(f"segment_starts[-1] = {starts[-1]} is past the {len(ids)} token_ids")
        if mask is not None and any(mask[i] for i in starts):
            i = next(i for i in starts if mask[i])
            raise ValueError(f"action_mask[{i}] must be 0: a segment's first token has no prefix")
        return starts

    @property
    def action_tokens(self) -> int:
        """Tokens the policy generated and the loss trains on (see count_action_tokens)."""
        return count_action_tokens(self.action_mask)


class TrajectoryBatch(BaseModel):
    """The body of POST /v1/trajectories/batch: records that are judged one by one.

    The schema holds for the whole batch (one malformed record refuses the call, naming its
    index, and nothing is buffered); acceptance is per record, since a batch that straddles a
    policy swap carries records of both versions and only the old ones are stale.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    trajectories: list[Trajectory] = Field(min_length=1, max_length=MAX_TRAJECTORIES_PER_CALL)


class Delivered(BaseModel):
    """The learner's answer for one record of a batch: the status the single route would give."""

    request_id: str
    status: int
    accepted: bool
    position: int | None = None
    code: str | None = None
    message: str | None = None
