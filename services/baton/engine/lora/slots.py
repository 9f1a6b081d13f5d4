"""The resident adapters: `max_loras` slots of every adapted linear's buffers, filled from
host copies on the engine thread when a step needs an adapter that is not resident, the
least recently used one not in that step evicted (a copy, never a file read)."""

from __future__ import annotations

from collections import OrderedDict

from baton.engine.lora.adapter import LoRAAdapter
from baton.engine.lora.layer import LoRAEmbedding, LoRALinear
from baton.engine.lora.stats import LoRACounters


class LoRASlots:
    """Engine thread only. `layers`: the model's LoRALinears (and LoRAEmbedding) by target
    name."""

    def __init__(self, layers: dict[str, LoRALinear | LoRAEmbedding], capacity: int,
                 counters: LoRACounters) -> None:
        self.layers, self.capacity, self.counters = layers, capacity, counters
        self._resident: OrderedDict[int, tuple[int, LoRAAdapter]] = OrderedDict()  # LRU first

    def resident_names(self) -> list[str]:
        return [adapter.name for _, adapter in self._resident.values()]

    def activate(self, adapters: list[LoRAAdapter]) -> dict[int, int]:
        """Make `adapters` (distinct, at most `capacity`: the scheduler's limit) resident;
        returns load_id -> slot. RuntimeError when they are more than the slots."""
        if len(adapters) > self.capacity:
            raise RuntimeError(f"a step needs {len(adapters)} LoRA adapters but "
                               f"--max-loras is {self.capacity}")
        wanted = {a.load_id for a in adapters}
        slots = {}
        for adapter in adapters:
            if adapter.load_id in self._resident:
                self._resident.move_to_end(adapter.load_id)
            else:
                self._load(adapter, self._free_slot(wanted))
            slots[adapter.load_id] = self._resident[adapter.load_id][0]
        return slots

    def _free_slot(self, keep: set[int]) -> int:
        """The lowest free slot (the fewer slots in use, the less each step computes),
        else the least recently used one's whose adapter the step does not need."""
        used = {slot for slot, _ in self._resident.values()}
        free = [s for s in range(self.capacity) if s not in used]
        if free:
            return free[0]
        victim = next(k for k in self._resident if k not in keep)
        slot, adapter = self._resident.pop(victim)
        self.counters.count("evictions", adapter.name)
        return slot

    def _load(self, adapter: LoRAAdapter, slot: int) -> None:
        for target, layer in self.layers.items():
            weights = adapter.weights.get(target)
            if weights is None:
                layer.a[slot].zero_()
                for b in layer.b:
                    b[slot].zero_()
                layer.adapted.discard(slot)
                continue
            layer.adapted.add(slot)
            a, bt = weights  # (P R, in), (P R, out)
            layer.a[slot].copy_(a)
            rank = layer.b[0].shape[1]
            for p, ((first, cols), b) in enumerate(zip(layer.parts, layer.b)):
                b[slot].copy_(bt[p * rank:(p + 1) * rank, first:first + cols])
        self._resident[adapter.load_id] = (slot, adapter)
        self.counters.count("loads", adapter.name)
