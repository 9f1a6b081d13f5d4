"""Adapters in and out of an engine: what is refused at load (by name), run-time load and
unload, and the LRU between resident slots (`max_loras`) and host copies (`max_cpu_loras`)
keeping every request exact while adapters come and go."""

from __future__ import annotations

import json

import pytest

from baton import LLM, SamplingParams
from baton.engine.lora import LoRAError, UnknownLoRAError
from tests.unit.engine.lora.tiny_lora import save_adapter, tiny_base
from tests.unit.engine.models.parity import hf_greedy, prompts_for

ARGS = dict(skip_tokenizer_init=True, dtype="float32", block_size=16)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    base = tiny_base(root / "base")
    peft = {f"a{i}": save_adapter(base, root / f"a{i}", seed=10 + i, r=4 + 2 * i)
            for i in range(3)}
    return root, base, peft


def llm_with(root, **kwargs) -> LLM:
    return LLM(str(root / "base"), **(ARGS | kwargs))


@pytest.mark.parametrize("config,message", [
    (dict(r=32), "rank 32 .* above --max-lora-rank 16"),
    (dict(use_dora=True), "DoRA"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
])
def test_refused_at_load_by_name(models, tmp_path, config, message):
    root, base, _ = models
    save_adapter(base, tmp_path / "bad", seed=0, **config)
    with pytest.raises(LoRAError, match=message):
        llm_with(root, lora_modules=[f"bad={tmp_path / 'bad'}"])


def test_missing_or_foreign_files_are_refused(models, tmp_path):
    root, base, _ = models
    with pytest.raises(LoRAError, match="adapter_config.json or adapter_model.safetensors"):
        llm_with(root, lora_modules=[f"x={tmp_path}"])
    save_adapter(base, tmp_path / "ok", seed=0)
    config = json.loads((tmp_path / "ok" / "adapter_config.json").read_text())
    (tmp_path / "ok" / "adapter_config.json").write_text(json.dumps(config | {"bias": "all"}))
    with pytest.raises(LoRAError, match="biases"):
        llm_with(root, lora_modules=[f"x={tmp_path / 'ok'}"])


def test_load_unload_at_run_time(models):
    root, base, peft = models
    llm = llm_with(root, enable_lora=True)
    prompt = prompts_for(1000, lengths=(30,))
    with pytest.raises(UnknownLoRAError, match="'a0' does not exist"):
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request="a0")
    llm.lora_registry.add("a0", str(root / "a0"))
    with pytest.raises(LoRAError, match="already loaded"):
        llm.lora_registry.add("a0", str(root / "a1"))
    out = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request="a0")
    assert out[0].outputs[0].token_ids == hf_greedy(peft["a0"], prompt, 6)[0]
    llm.lora_registry.remove("a0")
    with pytest.raises(UnknownLoRAError):
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request="a0")


def test_lora_requests_need_an_engine_with_lora(models):
    root, _, _ = models
    llm = llm_with(root)
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        llm.generate(prompts_for(1000, lengths=(5,)), GREEDY, use_tqdm=False,
                     lora_request="a0")


def test_more_adapters_than_slots_and_host_copies(models):
    """Three adapters and the base in one call, one resident slot and two host copies: the
    scheduler runs one adapter at a time beside the base, slots and host copies are
    evicted and reloaded, and every request still equals peft's."""
    root, base, peft = models
    llm = llm_with(root, max_loras=1, max_cpu_loras=2,
                   lora_modules=[f"{n}={root / n}" for n in peft])
    registry = llm.lora_registry
    assert len(registry.host_names()) == 2  # the first one loaded was dropped already
    prompts = prompts_for(1000, lengths=(9, 33, 17, 48))
    names = [None, "a0", "a1", "a2"]
    outs = llm.generate(prompts * 2, GREEDY, use_tqdm=False, lora_request=names * 2)
    for i, out in enumerate(outs):
        name = names[i % 4]
        ref = hf_greedy(base if name is None else peft[name], [prompts[i % 4]], 6)[0]
        assert out.outputs[0].token_ids == ref, name
    counts = registry.counters.snapshot()
    assert sum(counts["loads"].values()) >= 3 and sum(counts["evictions"].values()) >= 2
    # three adapters cycling through two host copies: each one read at start and again
    # at each of its two turns (dropped by then)
    assert counts["host_loads"] == {"a0": 3, "a1": 3, "a2": 3}
    assert counts["requests"] == {"a0": 2, "a1": 2, "a2": 2}
    llm.engine.check_integrity()
