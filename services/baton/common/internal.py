"""The internal wire between the router, prefill pods and decode pods (no torch).

Every message that crosses a pod boundary on the disaggregated path is one of these pydantic
models, validated once where it arrives; nobody builds or parses these bodies by hand.

    router -> prefill  POST /internal/prefill   PrefillRequest  -> PrefillResponse
    router -> decode   POST /internal/generate  GenerateRequest -> the OpenAI answer
                                                (SSE; with `return_token_ids`, each content
                                                event is preceded by a `TokenEvent`)

`KVTransferParams` is what a prefill engine hands out for a request whose KV it holds: where
to pull it from (`endpoint`), which blocks, under which lease, and the first token it
sampled. The decode engine takes it back as is (`engine.kv_connector.PullKV`).

Token events are SSE events of their own type (`event: baton.tokens`), so the router reads
token ids without parsing (or rewriting) the OpenAI content events, and drops them before
the client sees the stream. A token event names the tokens of the content event that
follows it; the router counts them as sent only once that content event went through.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, Self, TypeAlias

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_serializer,
    model_serializer,
    model_validator,
)
from pydantic.dataclasses import dataclass

from baton.common.protocol import MAX_LOGPROBS, ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:  # KVLayoutInfo.of reads a tensor's shape; this module never loads torch
    import torch

WIRE_VERSION: Final = 1
# On every answer of a worker: "<WIRE_VERSION>/<worker id>" (the id it registers under), so
# a router believes only a Baton worker of its wire version, and the process it meant
WORKER_HEADER: Final = "X-Baton-Worker"


def worker_header(worker_id: str) -> str:
    """The WORKER_HEADER value of the worker `worker_id`."""
    return f"{WIRE_VERSION}/{worker_id}"
TOKENS_EVENT = "baton.tokens"
API_MODELS: dict[str, type[BaseModel]] = {"chat": ChatCompletionRequest,
                                          "completions": CompletionRequest}
Api = Literal["chat", "completions"]
OpenAIBody: TypeAlias = ChatCompletionRequest | CompletionRequest
TokenId = Annotated[int, Field(ge=0)]
_WIRE = ConfigDict(extra="forbid", frozen=True)


# -- KV hand-over --------------------------------------------------------------------------
# The layout and the endpoint are pydantic dataclasses: one type each for the transports
# (`baton.kv_transfer`), the tensor-parallel control frames and this wire, positional or by
# keyword, validated wherever they are made.
@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class KVLayoutInfo:
    """One rank's KV cache shape. With tensor parallelism a rank holds `num_kv_heads` of the
    model's `total_kv_heads` (0: all of them), the global heads [head_start, head_start +
    num_kv_heads), one of `tp_size` ranks. The fingerprint covers only what every rank of
    every TP degree shares (layers, block size, total heads, head dim, dtype): peers of
    different TP degrees handshake, and each pull names the heads it moves. The device type
    is part of it too (nixl reads DRAM or VRAM, gloo / nccl need the same kind on both
    sides); a layout on the wire without one is a host cache's. ValueError (a pydantic
    ValidationError) for heads outside the model's."""

    num_layers: Annotated[int, Field(ge=1)]
    block_size: Annotated[int, Field(ge=1)]
    num_kv_heads: Annotated[int, Field(ge=1)]
    head_dim: Annotated[int, Field(ge=1)]
    dtype: str  # torch dtype name, e.g. "bfloat16"
    total_kv_heads: Annotated[int, Field(ge=0)] = 0
    head_start: Annotated[int, Field(ge=0)] = 0
    tp_size: Annotated[int, Field(ge=1)] = 1
    device: Annotated[str, Field(min_length=1, max_length=16)] = "cpu"  # cache device type

    def __post_init__(self) -> None:
        if self.total_kv_heads == 0:
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads)
        if self.head_start + self.num_kv_heads > self.total_kv_heads:
            raise ValueError(f"heads [{self.head_start}, {self.head_start + self.num_kv_heads})"
                             f" outside the model's {self.total_kv_heads} KV heads "
                             f"(tp_size {self.tp_size})")

    @classmethod
    def of(cls, kv_cache: torch.Tensor, head_start: int = 0, total_kv_heads: int = 0,
           tp_size: int = 1) -> KVLayoutInfo:
        """The layout of an engine's cache tensor `[layers, 2, blocks, block_size, kv_heads,
        head_dim]` (read from its shape, dtype and device: torch is not imported here)."""
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError("the KV cache must be [layers, 2, blocks, block_size, kv_heads, "
                             f"head_dim], got {tuple(kv_cache.shape)}")
        layers, _, _, bs, kvh, d = kv_cache.shape
        return cls(layers, bs, kvh, d, str(kv_cache.dtype).removeprefix("torch."),
                   total_kv_heads, head_start, tp_size, kv_cache.device.type)

    @model_serializer(mode="wrap")
    def _whole_as_before(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        """A whole host cache (TP=1) on the wire exactly as before tensor parallelism and
        device types."""
        data: dict[str, object] = handler(self)
        if self.device == "cpu":
            data.pop("device", None)
        if self.is_whole and self.tp_size == 1:
            for key in ("total_kv_heads", "head_start", "tp_size"):
                data.pop(key, None)
        return data

    @property
    def heads(self) -> tuple[int, int]:
        """This rank's global KV heads, [start, end)."""
        return self.head_start, self.head_start + self.num_kv_heads

    @property
    def is_whole(self) -> bool:
        return self.num_kv_heads == self.total_kv_heads

    @property
    def fingerprint(self) -> str:
        raw = f"{self.num_layers}/{self.block_size}/{self.total_kv_heads}/{self.head_dim}/" \
              f"{self.dtype}"
        if self.device != "cpu":  # a host cache's fingerprint as before devices were named
            raw += f"/{self.device}"
        return hashlib.blake2b(raw.encode(), digest_size=8).hexdigest()

    def mismatch(self, other: KVLayoutInfo) -> str:
        """What makes two layouts' blocks incompatible whatever their TP degrees ('' when
        nothing does)."""
        diffs = [f"{k} {getattr(self, k)} vs {getattr(other, k)}"
                 for k in ("num_layers", "block_size", "total_kv_heads", "head_dim", "dtype",
                           "device")
                 if getattr(self, k) != getattr(other, k)]
        return ", ".join(diffs)


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class KVEndpointInfo:
    """How a puller reaches a holder: the transport's name, the holder's engine id, its
    address (host:port; the engine id for `local`) and its cache's layout."""

    transport: str
    engine_id: str
    address: str
    layout: KVLayoutInfo


class FirstTokenLogprobs(BaseModel):
    """The logprobs of the token a prefill sampled, as its sampler computed them (from the
    raw distribution): the decode pod reports them as its first token's."""

    model_config = _WIRE
    logprob: float
    rank: Annotated[int, Field(ge=1)]
    top: Annotated[list[tuple[TokenId, float]], Field(max_length=MAX_LOGPROBS)] = []


class KVTransferParams(BaseModel):
    """A prefill's KV, held under `lease_id` for `lease_ttl_s`: `block_ids` on the holder
    cover the prompt's `num_tokens` tokens; `first_token` is the token the prefill sampled
    (with its logprobs when the request asked for them)."""

    model_config = _WIRE
    v: Literal[1] = WIRE_VERSION
    endpoint: KVEndpointInfo
    block_ids: Annotated[list[TokenId], Field(min_length=1)]
    num_tokens: Annotated[int, Field(ge=1)]
    lease_id: Annotated[str, Field(min_length=1)]
    first_token: TokenId
    lease_ttl_s: Annotated[float, Field(gt=0)]
    first_token_logprobs: FirstTokenLogprobs | None = None
    # a tensor-parallel holder: every rank's endpoint (rank 0's is `endpoint`), each with
    # its KV heads; None for one rank (TP=1, the wire as before)
    rank_endpoints: Annotated[list[KVEndpointInfo], Field(min_length=2, max_length=64)] | \
        None = None

    @model_serializer(mode="wrap")
    def _one_rank_as_before(self, handler: SerializerFunctionWrapHandler
                            ) -> dict[str, object]:
        data: dict[str, object] = handler(self)
        if self.rank_endpoints is None:
            data.pop("rank_endpoints", None)
        return data


# -- router <-> workers --------------------------------------------------------------------
class _WithOpenAIBody(BaseModel):
    """An internal message carrying the client's OpenAI body, typed by `api`."""

    model_config = _WIRE
    v: Literal[1] = WIRE_VERSION
    api: Api
    request: OpenAIBody

    @model_validator(mode="before")
    @classmethod
    def _body_of_api(cls, data: object) -> object:
        if isinstance(data, dict) and isinstance(data.get("request"), dict):
            model = API_MODELS.get(data.get("api", ""))
            if model is not None:
                data = {**data, "request": model.model_validate(data["request"])}
        return data

    @model_validator(mode="after")
    def _body_matches_api(self) -> Self:
        if not isinstance(self.request, API_MODELS[self.api]):
            raise ValueError(f"api {self.api!r} does not match the request body")
        return self

    @field_serializer("request")
    def _client_fields_only(self, request: OpenAIBody) -> dict[str, Any]:
        return request.model_dump(exclude_unset=True)  # the body as the client sent it

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()


def _check_peer_prefix(peer: KVTransferParams | None, ids: list[int] | None) -> None:
    """A peer's prefix covers fewer tokens than the prompt's ids it comes with."""
    if peer is not None and (not ids or peer.num_tokens >= len(ids)):
        raise ValueError("a peer_prefix covers fewer tokens than the prompt_token_ids it "
                         "comes with")


class PrefillRequest(_WithOpenAIBody):
    """Compute the prompt's KV, sample its first token, and hold the KV for a decode pod.
    `peer_prefix`: another pod lends the KV of the prompt's first `num_tokens` tokens (the
    router's peer fetch); pull it, compute the rest. It comes with `prompt_token_ids`, the
    prompt as the router tokenized it (what the lease's blocks were computed from)."""

    prompt_token_ids: list[TokenId] | None = None
    peer_prefix: KVTransferParams | None = None

    @model_validator(mode="after")
    def _peer_with_ids(self) -> Self:
        ids, peer = self.prompt_token_ids, self.peer_prefix
        _check_peer_prefix(peer, ids)
        if ids is not None and peer is None:
            raise ValueError("prompt_token_ids come with a peer_prefix")
        return self


class PrefillResponse(BaseModel):
    model_config = _WIRE
    v: Literal[1] = WIRE_VERSION
    prompt_token_ids: Annotated[list[TokenId], Field(min_length=1)]
    kv_transfer_params: KVTransferParams
    prefill_s: Annotated[float, Field(ge=0)]


class ReleaseRequest(BaseModel):
    """A router to a prefill pod: nobody will pull this lease (its client left)."""

    model_config = _WIRE
    v: Literal[1] = WIRE_VERSION
    lease_id: Annotated[str, Field(min_length=1, max_length=256)]


class ResumeState(BaseModel):
    """A stream another decode pod started: the original prompt's length, the tokens (and
    characters) the client already has, and the stream's `created` stamp."""

    model_config = _WIRE
    prompt_tokens: Annotated[int, Field(ge=1)]
    completion_tokens: Annotated[int, Field(ge=0)] = 0
    text_offset: Annotated[int, Field(ge=0)] = 0
    created: int | None = None


class GenerateRequest(_WithOpenAIBody):
    """Generate on a decode pod. With `kv_transfer_params` the prompt's KV is pulled from a
    prefill pod; without, the decode pod prefills `prompt_token_ids` (or the body's prompt)
    itself. `resume`: `prompt_token_ids` is the original prompt + the tokens already sent.
    `peer_prefix`: another pod holds the KV of the prompt's first `num_tokens` tokens (a
    conversation that moved): the decode pod pulls them and prefills only the rest."""

    prompt_token_ids: list[TokenId] | None = None
    kv_transfer_params: KVTransferParams | None = None
    peer_prefix: KVTransferParams | None = None
    return_token_ids: bool = False
    resume: ResumeState | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        ids, resume, peer = self.prompt_token_ids, self.resume, self.peer_prefix
        if self.kv_transfer_params is not None and not ids:
            raise ValueError("kv_transfer_params need the prompt_token_ids they cover")
        _check_peer_prefix(peer, ids)
        if peer is not None and self.kv_transfer_params is not None:
            raise ValueError("a peer_prefix never comes with kv_transfer_params")
        if resume is not None and (ids is None or resume.prompt_tokens > len(ids) or
                                   resume.prompt_tokens + resume.completion_tokens != len(ids)):
            raise ValueError("a resumed request gives prompt_token_ids = the original prompt "
                             "+ the tokens already sent")
        return self


# -- token ids beside a decode pod's stream ------------------------------------------------
class StreamHeader(BaseModel):
    """The fields every chunk of one OpenAI stream repeats."""

    model_config = _WIRE
    id: str
    object: str
    created: int
    model: str


class TokenEvent(BaseModel):
    """What the router needs to resume a stream, sent before the content event it describes.

    The first one of a stream (before any content) has the prompt's ids and the response's
    `header`; later ones have the `token_ids` and the
    `text_chars` of the content event that follows, and `finished` on the last."""

    model_config = _WIRE
    v: Literal[1] = WIRE_VERSION
    prompt_token_ids: list[TokenId] | None = None
    header: StreamHeader | None = None
    token_ids: list[TokenId] = []
    text_chars: Annotated[int, Field(ge=0)] = 0
    finished: bool = False

    def sse(self) -> bytes:
        data = self.model_dump_json(exclude_defaults=True)
        return f"event: {TOKENS_EVENT}\ndata: {data}\n\n".encode()

    @classmethod
    def from_sse(cls, event: bytes) -> TokenEvent | None:
        """The token event in one SSE event block (no trailing blank line), else None."""
        head, _, rest = event.partition(b"\n")
        if head != b"event: " + TOKENS_EVENT.encode() or not rest.startswith(b"data: "):
            return None
        return cls.model_validate(json.loads(rest[6:]))
