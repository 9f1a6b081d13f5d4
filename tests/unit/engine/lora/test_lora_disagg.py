"""An adapter's request handed over prefill -> decode (local transport): the prefill engine
computes the prompt's KV with the adapter, the decode engine pulls it and goes on with the
same adapter; the tokens are peft's, and the pulled blocks serve only that adapter."""

from __future__ import annotations

import time

from baton import SamplingParams
from baton.engine.config import EngineConfig
from baton.engine.core import EngineCore
from baton.engine.kv_connector import HoldKV, PullKV
from tests.unit.engine.lora.tiny_lora import save_adapter, tiny_base
from tests.unit.engine.models.parity import hf_greedy, prompts_for

N = 6


def engine(root, role: str) -> EngineCore:
    return EngineCore(EngineConfig.from_args(
        model=str(root / "base"), skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64,
        kv_transport="local", engine_id=f"{role}-{time.monotonic_ns()}",
        lora_modules=[f"a={root / 'a'}"]))


def run(core: EngineCore, rid: str) -> list:
    outs = []
    deadline = time.monotonic() + 30
    while not any(o.request_id == rid and o.finished for o in outs):
        assert time.monotonic() < deadline
        outs += core.step()
        time.sleep(0.001)
    return [o for o in outs if o.request_id == rid]


def test_an_adapter_request_continues_on_the_decode_engine(tmp_path):
    base = tiny_base(tmp_path / "base")
    peft = save_adapter(base, tmp_path / "a", seed=4, r=8)
    prefill, decode = engine(tmp_path, "prefill"), engine(tmp_path, "decode")
    prompt = prompts_for(1000, lengths=(45,), seed=9)[0]
    try:
        lora = prefill.runner.lora.registry.get("a")
        req = prefill.make_request("p", prompt, SamplingParams(temperature=0, max_tokens=1),
                                   kv=HoldKV(), lora=lora)
        prefill.add(req)
        params = run(prefill, "p")[-1].kv_transfer_params
        assert params is not None
        req = decode.make_request("d", prompt, SamplingParams(temperature=0, max_tokens=N),
                                  kv=PullKV(params), lora=decode.runner.lora.registry.get("a"))
        outs = decode.add(req) + run(decode, "d")
        tokens = [t for o in outs for t in o.new_token_ids]
        assert tokens == hf_greedy(peft, [prompt], N)[0]
        # the pulled prompt's blocks are the adapter's: the base model misses them
        base_req = decode.make_request("b", prompt, SamplingParams(temperature=0, max_tokens=1))
        assert decode.kv.get_computed_blocks(base_req)[1] == 0
        again = decode.make_request("d2", prompt, SamplingParams(temperature=0, max_tokens=1),
                                    lora=decode.runner.lora.registry.get("a"))
        assert decode.kv.get_computed_blocks(again)[1] == 32  # two whole blocks of 45
    finally:
        prefill.close()
        decode.close()
