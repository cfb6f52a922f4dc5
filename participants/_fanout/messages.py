"""Every message and reply that crosses the fan-out channel, as tagged models.

A message is a pydantic model with a ``kind`` tag; :data:`Message` is their discriminated union and
:data:`FRAMES` the one adapter that reads a frame, the message inside included. Each message class
names its reply type as its generic argument (``class Close(Ask[Readiness])``), so
``Channel.request(Close(...))`` returns a :class:`Readiness`, checked where it arrives.

Which end answers which message is fixed here too: :data:`TO_SHARD` (the fan-out in the main
process asks a shard process), :data:`TO_FANOUT` (a shard process asks the fan-out), and the two
model-server extensions :data:`SHARE_TO_SHARD` and :data:`CUTS_TO_FANOUT`.
"""

from __future__ import annotations

from functools import cache
from typing import Annotated, Any, Final, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from protocols import CheckpointRequest, EpisodeId, GenerationCutRecord, PrepareReport

ReplyT = TypeVar("ReplyT")

Record = dict[str, Any]
"""One participant record in its JSON form (as ``participants.Record``)."""


class _Closed(BaseModel):
    # Both ends run the same code: anything the models do not describe exactly is a bug.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Ask(_Closed, Generic[ReplyT]):
    """A message whose reply is a ``ReplyT``; every message of the channel is one."""

    kind: str
    """The tag (each message narrows it to its own ``Literal``)."""


@cache
def reply_adapter(message_type: type[Ask[Any]]) -> TypeAdapter[Any]:
    """The adapter that checks the reply of ``message_type`` (its ``Ask[...]`` argument)."""
    for base in message_type.__mro__:
        metadata = getattr(base, "__pydantic_generic_metadata__", None)
        if metadata and metadata["origin"] is Ask and metadata["args"]:
            return TypeAdapter(metadata["args"][0])
    raise TypeError(f"{message_type.__name__} does not name its reply type: subclass Ask[...]")


def describe(exc: ValidationError, what: str = "value") -> str:
    """One line naming what failed validation (at most three places; ``what`` names the top)."""
    parts = []
    for error in exc.errors()[:3]:
        location = ".".join(str(part) for part in error.get("loc", ()))
        parts.append(f"{location or what}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid"


# ------------------------------------------------------------------------------- replies


class Readiness(_Closed):
    """One shard's readiness, as it pushes it and as its close reply.

    Attributes:
        generation: The close generation it answers (the fan-out ignores older ones).
        seq: Its sequence number (the fan-out keeps the newest).
        report: The shard participant's own report.
        served: Whether it served live work.
        restored_pending: Capture keys of its restored attempts that have not started.
        extra: Its participant's extra status fields.
    """

    generation: int
    seq: int
    report: PrepareReport
    served: bool
    restored_pending: list[str]
    extra: dict[str, Any]


class Registered(_Closed):
    """The fan-out's answer to a joining shard: what it adopts at once."""

    generation: int
    request: CheckpointRequest | None
    """The open checkpoint (its plain request), or ``None`` while admission is open."""
    marks: dict[str, int]
    """Retire marks and restore fences merged: rollout id → lowest attempt still accepted."""


class ServerHealth(_Closed):
    """What ``/healthz`` answers while not every slot has a shard (the keys are the wire's)."""

    ready: bool
    workers: int
    """Shards connected (the reply's field name predates the fan-out's own names)."""
    expected: int
    missing_slots: list[int]


class ServerMetrics(_Closed):
    """Every process's Prometheus text: the main process's, then each shard's by pid."""

    main: str
    shards: list[str]


class EpisodeShare(_Closed):
    """What one model shard holds of one episode (see ``docs/model-workers.md``)."""

    rows: list[dict[str, Any]]
    cut: GenerationCutRecord | None
    cut_admitted_at: float | None


class ModelShare(_Closed):
    """One model shard's share of a commit: its undelivered call ids and its episodes."""

    undelivered: list[str]
    episodes: dict[str, EpisodeShare]


# ------------------------------------------------------------------------------- shard → fan-out


class Register(Ask[Registered]):
    """A shard joins (first message on its connection)."""

    kind: Literal["register"] = "register"
    pid: int
    slot: int = Field(ge=0)


class Report(Ask[None]):
    """A shard's readiness changed."""

    kind: Literal["report"] = "report"
    readiness: Readiness


class Stopping(Ask[None]):
    """A shard is about to stop cleanly (so its going is not a loss)."""

    kind: Literal["stopping"] = "stopping"
    pid: int


class Claim(Ask[bool]):
    """A shard asks for the restored state of a capture key (claim placement)."""

    kind: Literal["claim"] = "claim"
    capture_key: str


class Control(Ask[dict[str, Any]]):
    """A control call a shard received over HTTP, relayed; the reply body as JSON data."""

    kind: Literal["control"] = "control"
    operation: str
    body: str
    """The HTTP body as received: the fan-out validates it as that operation's request."""


class GatherMetrics(Ask[ServerMetrics]):
    """A shard serves ``/metrics``: every process's text."""

    kind: Literal["gather_metrics"] = "gather_metrics"


class Health(Ask[ServerHealth]):
    """A shard serves ``/healthz``: is every slot taken?"""

    kind: Literal["health"] = "health"


class ClaimCut(Ask[GenerationCutRecord | None]):
    """A model shard asks for the restored cut its call continues (model fan-out only)."""

    kind: Literal["claim_cut"] = "claim_cut"
    capture_key: str
    request_digest: str


class ReturnCut(Ask[None]):
    """A model shard gives back a claimed cut no response used (model fan-out only)."""

    kind: Literal["return_cut"] = "return_cut"
    capture_key: str
    record: GenerationCutRecord


# ------------------------------------------------------------------------------- fan-out → shard


class Close(Ask[Readiness]):
    """Close admission under a new generation; the reply is the shard's first report."""

    kind: Literal["close"] = "close"
    request: CheckpointRequest
    generation: int


class Open(Ask[None]):
    """Reopen admission."""

    kind: Literal["open"] = "open"


class Marks(Ask[None]):
    """The whole, current set of refusals: rollout id → lowest attempt still accepted."""

    kind: Literal["marks"] = "marks"
    marks: dict[str, int]


class Retire(Ask[None]):
    """Stop and free the attempts any of ``episode_ids`` covers (one retire request's)."""

    kind: Literal["retire"] = "retire"
    episode_ids: list[EpisodeId] = Field(min_length=1)


class DeleteRestored(Ask[None]):
    """Drop the restored state of ``episode_ids`` (claimed elsewhere, or out of scope; D393)."""

    kind: Literal["delete_restored"] = "delete_restored"
    episode_ids: list[EpisodeId] = Field(min_length=1)


class CheckForget(Ask[None]):
    """Refuse now if these rollouts cannot be forgotten yet (every shard checks first)."""

    kind: Literal["check_forget"] = "check_forget"
    rollout_ids: list[str]


class Forget(Ask[None]):
    """Drop the retire marks of these rollouts."""

    kind: Literal["forget"] = "forget"
    rollout_ids: list[str]


class ExportRecords(Ask[list[Record]]):
    """This shard's records of the parked work in scope (``None``: all of it)."""

    kind: Literal["export_records"] = "export_records"
    scope: list[EpisodeId] | None


class Install(Ask[None]):
    """This shard's records of a restore, with the checkpoint's manifest."""

    kind: Literal["install"] = "install"
    records: list[Record]
    scope: list[EpisodeId]
    manifest: dict[str, Any] | None


class Park(Ask[None]):
    """Free what the last exported records hold."""

    kind: Literal["park"] = "park"


class ShardMetrics(Ask[str]):
    """This shard's Prometheus text."""

    kind: Literal["shard_metrics"] = "shard_metrics"


class ExportShare(Ask[ModelShare]):
    """A model shard's share of a commit, for the fan-out to merge (model fan-out only)."""

    kind: Literal["export_share"] = "export_share"
    scope: list[EpisodeId]


class InstallShare(Ask[None]):
    """A model shard's part of a restore (model fan-out only).

    Attributes:
        records: Every record when this shard imports the ledger, else none.
        scope: The restore scope when this shard imports, else empty.
        manifest: The checkpoint's manifest.
        import_ledger: Whether this shard imports the shared ledger (exactly one does).
        targets: The restored attempts of this shard's slot, to wait for.
        cut_keys: Every target whose cut the fan-out holds (a call of these asks for it).
    """

    kind: Literal["install_share"] = "install_share"
    records: list[Record]
    scope: list[EpisodeId]
    manifest: dict[str, Any] | None
    import_ledger: bool
    targets: list[str]
    cut_keys: list[str]


Message = Annotated[
    Register
    | Report
    | Stopping
    | Claim
    | Control
    | GatherMetrics
    | Health
    | ClaimCut
    | ReturnCut
    | Close
    | Open
    | Marks
    | Retire
    | DeleteRestored
    | CheckForget
    | Forget
    | ExportRecords
    | Install
    | Park
    | ShardMetrics
    | ExportShare
    | InstallShare,
    Field(discriminator="kind"),
]
"""Every message of the channel, told apart by ``kind``."""


def _kinds(*message_types: type[Ask[Any]]) -> frozenset[type[Ask[Any]]]:
    return frozenset(message_types)


TO_FANOUT: Final = _kinds(Register, Report, Stopping, Claim, Control, GatherMetrics, Health)
"""What every fan-out answers."""
CUTS_TO_FANOUT: Final = _kinds(ClaimCut, ReturnCut)
"""What the model server's fan-out answers besides."""
TO_SHARD: Final = _kinds(
    Close,
    Open,
    Marks,
    Retire,
    DeleteRestored,
    CheckForget,
    Forget,
    ExportRecords,
    Install,
    Park,
    ShardMetrics,
)
"""What every shard answers."""
SHARE_TO_SHARD: Final = _kinds(ExportShare, InstallShare)
"""What a shard whose participant exports shares (the model's) answers besides."""


# ------------------------------------------------------------------------------- frames


class ErrorBody(_Closed):
    """A typed refusal as it crosses the channel: its HTTP status, code and detail."""

    status: int
    code: str
    detail: str


class RequestFrame(_Closed):
    """``{"frame": "request", "id", "message", "traceparent"}`` (the asker's trace, if any)."""

    frame: Literal["request"] = "request"
    id: int
    message: Message
    traceparent: str | None = None


class ReplyFrame(_Closed):
    """``{"frame": "reply", "reply_to", "body"}``; the body is checked by the waiting request."""

    frame: Literal["reply"] = "reply"
    reply_to: int
    body: Any


class ErrorFrame(_Closed):
    """``{"frame": "error", "reply_to", "error"}``."""

    frame: Literal["error"] = "error"
    reply_to: int
    error: ErrorBody


Frame = Annotated[RequestFrame | ReplyFrame | ErrorFrame, Field(discriminator="frame")]
"""One frame of the channel."""

FRAMES: Final[TypeAdapter[RequestFrame | ReplyFrame | ErrorFrame]] = TypeAdapter(
    Frame,
    # NaN and the infinities cross as JSON's usual constants, as they did through ``json``: a
    # record's float is carried exactly, never turned into null (reference §4.6).
    config=ConfigDict(ser_json_inf_nan="constants"),
)
"""The one adapter that reads and writes every frame, the message inside a request included."""
