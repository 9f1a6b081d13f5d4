"""Live tuning from a mounted ConfigMap (docs/design.md §7): the file's schema, validation, and a
watcher that reloads it the way kubelet updates it.

The file (YAML, key `baton.yaml` of the tuning ConfigMap) has a `router` and a `worker`
section; every field is optional (absent = keep the service's own value):

    router:
      scorer_weights: {queue: 1.0, kv_usage: 1.0, prefix: 1.0}
      disagg_min_prefill_tokens: 256
      prefill_timeout_s: 60
      peer_fetch: true               # decode pods pull prompt prefixes peers hold
      peer_fetch_min_tokens: 256
      max_attempts: 3
      first_byte_timeout_s: 600
      idle_timeout_s: 120
      request_timeout_s: 1800
    worker:
      max_num_seqs: 64               # live, up to the value the worker started with
      max_num_batched_tokens: 1024   # live, likewise (buffers are sized at start)
      kv_lease_ttl_s: 30
      kv_transfer_timeout_s: 30
      kv_failure_policy: recompute
      speculative_config: {method: ngram, num_speculative_tokens: 4}   # live; {method: null}: off
      lora_modules: {sql: /models/adapters/sql}   # live: LoRA adapters loaded / unloaded
      restart: {dtype: bfloat16, num_kv_blocks: 4096, block_size: 16, max_model_len: 8192}

`restart` holds knobs read only at start; a reload that changes one says so in the log and
in `baton:config_restart_pending`. An invalid file (bad YAML, an unknown field, a wrong type,
an out-of-range value) is rejected with the field named; the old config stays. Every reload
is counted in `baton:config_reloads_total{result="applied"|"rejected"}`.

Kubelet mounts a ConfigMap as `dir/..<timestamp>/file`, `dir/..data -> ..<timestamp>` and
`dir/file -> ..data/file`, and updates it by renaming a new `..data` symlink over the old:
`ConfigWatcher` polls `readlink(..data)` (or, for a plain directory, the file's mtime and
size), so it sees each update exactly once and never a half-written file.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeAlias

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger("baton.config")
FILE_NAME = "baton.yaml"
_STRICT = ConfigDict(extra="forbid", strict=True)
_Seconds = Annotated[float, Field(gt=0)]


class RouterTuning(BaseModel):
    model_config = _STRICT
    scorer_weights: dict[str, Annotated[float, Field(ge=0)]] | None = None
    disagg_min_prefill_tokens: Annotated[int, Field(ge=0)] | None = None
    prefill_timeout_s: _Seconds | None = None
    peer_fetch: bool | None = None
    peer_fetch_min_tokens: Annotated[int, Field(ge=0)] | None = None
    max_attempts: Annotated[int, Field(ge=1)] | None = None
    first_byte_timeout_s: _Seconds | None = None
    idle_timeout_s: _Seconds | None = None
    request_timeout_s: _Seconds | None = None


class RestartKnobs(BaseModel):
    model_config = _STRICT
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    num_kv_blocks: Annotated[int, Field(ge=1)] | None = None
    block_size: Annotated[int, Field(ge=1)] | None = None
    max_model_len: Annotated[int, Field(ge=1)] | None = None


class WorkerTuning(BaseModel):
    model_config = _STRICT
    max_num_seqs: Annotated[int, Field(ge=1)] | None = None
    max_num_batched_tokens: Annotated[int, Field(ge=1)] | None = None
    kv_lease_ttl_s: _Seconds | None = None
    kv_transfer_timeout_s: _Seconds | None = None
    kv_failure_policy: Literal["recompute", "fail"] | None = None
    # `--speculative-config` as a mapping (`{method: null}` turns it off); the engine checks it
    speculative_config: dict[str, Any] | None = None
    # LoRA adapters this file serves, name -> path (a directory, a hub cache repo, hf://):
    # at start beside `--lora-modules`; on a reload the ones it adds load and the ones it
    # drops unload (`worker/tuning.py`); {} turns LoRA on with none
    lora_modules: dict[Annotated[str, Field(min_length=1, max_length=128)],
                       Annotated[str, Field(min_length=1)]] | None = None
    restart: RestartKnobs = Field(default_factory=RestartKnobs)


class Tuning(BaseModel):
    model_config = _STRICT
    router: RouterTuning = Field(default_factory=RouterTuning)
    worker: WorkerTuning = Field(default_factory=WorkerTuning)


class TuningError(ValueError):
    """The file cannot be used; the message names the field."""


def parse_tuning(text: str, source: str = "config") -> Tuning:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise TuningError(f"{source}: not valid YAML: {err}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise TuningError(f"{source}: the top level must be a mapping with router/worker")
    try:
        return Tuning.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                             for e in err.errors())
        raise TuningError(f"{source}: {problems}") from None


def load_tuning(path: str | os.PathLike[str]) -> Tuning:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise TuningError(f"{path}: cannot read: {err}") from None
    return parse_tuning(text, str(path))


def set_fields(model: BaseModel) -> dict[str, Any]:
    """The fields a file actually sets (None = keep the service's own value)."""
    return {k: v for k, v in model.model_dump(exclude={"restart"}).items() if v is not None}


Apply = Callable[[Tuning, Tuning], list[str]]
# the `..data` link's target and the file's mtime, size and inode (the link alone: no file)
_Stamp: TypeAlias = tuple[str | None, int, int, int] | tuple[str, None]


class ConfigWatcher:
    """Polls a mounted config directory; calls `apply(new, old)` on each valid change.

    `apply` raises TuningError to reject a change the service cannot take (the old config
    stays); it returns the names of changed knobs that need a restart. `on_result(result)`
    is called with "applied" or "rejected" for the metrics. Both can be given later, at
    `start`: a service reads the file at start (`load_initial`) before it can apply
    anything, and a change published in between is applied by the first poll."""

    def __init__(self, directory: str | os.PathLike[str], apply: Apply | None = None,
                 on_result: Callable[[str], None] | None = None, file_name: str = FILE_NAME,
                 interval_s: float = 1.0) -> None:
        self.dir = Path(directory)
        self.path = self.dir / file_name
        self.apply = apply
        self.on_result = on_result
        self.interval_s = interval_s
        self.current = Tuning()
        self.restart_pending: list[str] = []
        self._version: _Stamp | None = None
        self._task: asyncio.Task[None] | None = None

    def _stamp(self) -> _Stamp | None:
        """What changes when kubelet (or an editor) publishes a new file."""
        try:
            data = os.readlink(self.dir / "..data")
        except OSError:
            data = None
        try:
            st = self.path.stat()
        except OSError:
            return (data, None) if data else None
        return (data, st.st_mtime_ns, st.st_size, st.st_ino)

    def load_initial(self) -> Tuning:
        """At start: a missing file is no tuning; an invalid one is an error (exit)."""
        self._version = self._stamp()
        if self._version is None:
            return self.current
        self.current = load_tuning(self.path)
        return self.current

    def check(self) -> str | None:
        """One poll: "applied", "rejected", or None when nothing changed."""
        stamp = self._stamp()
        if stamp == self._version:
            return None
        self._version = stamp
        try:
            new = load_tuning(self.path)
            assert self.apply is not None  # given at construction or `start`, before polls
            self.restart_pending = self.apply(new, self.current)
        except TuningError as err:
            log.error("config reload rejected, keeping the old config: %s", err)
            assert self.on_result is not None  # as `apply`
            self.on_result("rejected")
            return "rejected"
        self.current = new
        log.info("config reloaded from %s%s", self.path,
                 f"; needs a restart to take effect: {', '.join(self.restart_pending)}"
                 if self.restart_pending else "")
        assert self.on_result is not None  # as `apply`
        self.on_result("applied")
        return "applied"

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a watcher bug must not stop the service
                log.exception("config watcher failed; retrying")

    def start(self, apply: Apply | None = None,
              on_result: Callable[[str], None] | None = None) -> None:
        self.apply = apply or self.apply
        self.on_result = on_result or self.on_result
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
