"""The adapters an engine serves: name -> path, and a host copy of up to `--max-cpu-loras` of
them (least recently used dropped; dropped ones are read again when asked for). Any thread:
loads read files and build host copies outside the lock, so call `add` and `get` off the
event loop and off the engine thread (the worker does, `asyncio.to_thread`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from baton.engine.lora.adapter import LoRAAdapter
from baton.engine.lora.config import check_name
from baton.engine.lora.errors import LoRAError, UnknownLoRAError
from baton.engine.lora.stats import LoRACounters

# (name, path, load_id) -> the host copy; raises LoRAError
Builder = Callable[[str, str, int], LoRAAdapter]


class AdapterRegistry:
    def __init__(self, build: Builder, host_capacity: int, counters: LoRACounters) -> None:
        self._build, self.host_capacity, self.counters = build, host_capacity, counters
        self._lock = threading.Lock()
        self._paths: dict[str, str] = {}
        self._roots: dict[str, int] = {}  # name -> its KV hash root (`LoRAAdapter.root_hash`)
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recent first
        self._next_id = 1

    def names(self) -> list[str]:
        with self._lock:
            return list(self._paths)

    def paths(self) -> dict[str, str]:
        """name -> the path it was loaded from, every adapter served."""
        with self._lock:
            return dict(self._paths)

    def roots(self) -> dict[str, int]:
        """name -> the KV hash root its requests' block hashes chain from (as loaded)."""
        with self._lock:
            return dict(self._roots)

    def host_names(self) -> list[str]:
        with self._lock:
            return list(self._host)

    def add(self, name: str, path: str) -> LoRAAdapter:
        """Load `name` from `path` and serve it. LoRAError when another adapter has the name
        or the adapter cannot be served (the worker keeps its served model names apart)."""
        try:
            check_name(name)
        except ValueError as err:
            raise LoRAError(str(err)) from None
        with self._lock:
            if name in self._paths:
                raise LoRAError(f"the LoRA adapter {name!r} is already loaded (from "
                                f"{self._paths[name]}); unload it first")
        adapter = self._load(name, path)
        with self._lock:
            if name in self._paths:  # another thread added it meanwhile
                raise LoRAError(f"the name {name!r} is already served")
            self._paths[name] = path
            self._roots[name] = adapter.root_hash
            self._keep(adapter)
        return adapter

    def remove(self, name: str) -> None:
        """Stop serving `name` (requests running with it finish with their copy);
        UnknownLoRAError if it is not served."""
        with self._lock:
            if self._paths.pop(name, None) is None:
                raise UnknownLoRAError(name, list(self._paths))
            self._host.pop(name, None)
            self._roots.pop(name, None)

    def get(self, name: str) -> LoRAAdapter:
        """The host copy of `name` for a request (read again if it was dropped), counted as
        one request; UnknownLoRAError if it is not served."""
        with self._lock:
            path = self._paths.get(name)
            if path is None:
                raise UnknownLoRAError(name, list(self._paths))
            adapter = self._host.get(name)
            if adapter is not None:
                self._host.move_to_end(name)
        if adapter is None:
            adapter = self._load(name, path)
            with self._lock:
                if self._paths.get(name) == path:
                    self._keep(adapter)
        self.counters.count("requests", name)
        return adapter

    def _load(self, name: str, path: str) -> LoRAAdapter:
        with self._lock:
            load_id, self._next_id = self._next_id, self._next_id + 1
        adapter = self._build(name, path, load_id)
        self.counters.count("host_loads", name)
        return adapter

    def _keep(self, adapter: LoRAAdapter) -> None:
        """Hold `adapter`'s host copy, dropping the least recent beyond capacity (lock held)."""
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        while len(self._host) > self.host_capacity:
            dropped, _ = self._host.popitem(last=False)
            self.counters.count("host_evictions", dropped)
