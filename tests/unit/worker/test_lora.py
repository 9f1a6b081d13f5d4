"""LoRA adapters through a worker over a real tiny engine: a request's `model` names an
adapter (its tokens are peft's) or the base, unknown names are 404s, adapters load and
unload at run time (vLLM's endpoints and answers), `/v1/models` lists them with their base
as `parent`, and `/metrics` counts requests, loads and evictions per adapter."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import pytest

from baton.engine.config import EngineConfig
from baton.worker.app import build_app
from baton.worker.state import WorkerSettings, WorkerState
from tests.unit.engine.lora.tiny_lora import save_adapter, tiny_base
from tests.unit.engine.models.parity import hf_greedy
from tests.unit.worker.fakes import asgi_call

PROMPT = [5, 17, 300, 42, 9, 81]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("worker_lora")
    base = tiny_base(root / "tiny")
    peft = {n: save_adapter(base, root / n, seed=s, r=4) for n, s in (("a0", 1), ("a1", 2))}
    engine = EngineConfig.from_args(model=str(root / "tiny"), dtype="float32",
                                    num_kv_blocks=32, skip_tokenizer_init=True, max_loras=1,
                                    lora_modules=[f"a0={root / 'a0'}"])
    state = WorkerState(WorkerSettings(engine=engine, served_model_name="tiny"))
    state.load()
    yield build_app(state.settings, state), root, base, peft
    state.engine.shutdown()


def call(app, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
    code, _, raw = asyncio.run(asgi_call(app, method, path, body))
    return code, raw.decode()


def tokens(app, model: str) -> tuple[int, list[int] | dict]:
    code, raw = call(app, "POST", "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
        "ignore_eos": True, "logprobs": 0})
    body = json.loads(raw)
    if code != 200:
        return code, body
    return code, [int(t.split(":")[1]) for t in body["choices"][0]["logprobs"]["tokens"]]


def test_requests_name_an_adapter_or_the_base(setup):
    app, _, base, peft = setup
    assert tokens(app, "a0") == (200, hf_greedy(peft["a0"], [PROMPT], 5)[0])
    assert tokens(app, "tiny") == (200, hf_greedy(base, [PROMPT], 5)[0])
    code, body = tokens(app, "a9")
    assert code == 404 and body["error"]["code"] == "model_not_found"
    assert "'tiny', 'a0'" in body["error"]["message"]


def test_models_lists_adapters_with_their_parent(setup):
    app, root, _, _ = setup
    code, raw = call(app, "GET", "/v1/models")
    cards = {m["id"]: m for m in json.loads(raw)["data"]}
    assert code == 200 and list(cards) == ["tiny", "a0"]
    assert cards["a0"]["parent"] == "tiny" and cards["a0"]["root"] == str(root / "a0")
    assert "parent" not in cards["tiny"]
    code, raw = call(app, "GET", "/load")  # what routers and the registry read
    load = json.loads(raw)
    assert load["lora_adapters"] == ["a0"] and "a0" in load["lora_loaded"]
    assert set(load["lora_roots"]) == {"a0"}


def test_load_and_unload_at_run_time(setup):
    app, root, _, peft = setup
    load, unload = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
    assert tokens(app, "a1")[0] == 404
    code, text = call(app, "POST", load, {"lora_name": "a1", "lora_path": str(root / "a1")})
    assert (code, text) == (200, "Success: LoRA adapter 'a1' added successfully.")
    assert tokens(app, "a1") == (200, hf_greedy(peft["a1"], [PROMPT], 5)[0])
    for body, param in (({"lora_name": "a1", "lora_path": str(root / "a0")}, "lora_path"),
                        ({"lora_name": "tiny", "lora_path": str(root / "a0")}, "lora_name"),
                        ({"lora_name": "x", "lora_path": str(root / "nowhere")}, "lora_path"),
                        ({"lora_name": "x"}, "lora_path")):
        code, raw = call(app, "POST", load, body)
        assert code == 400 and json.loads(raw)["error"]["param"] == param, raw
    code, text = call(app, "POST", unload, {"lora_name": "a1"})
    assert (code, text) == (200, "Success: LoRA adapter 'a1' removed successfully.")
    code, raw = call(app, "POST", unload, {"lora_name": "a1"})
    assert code == 404 and json.loads(raw)["error"]["code"] == "lora_not_found"
    assert tokens(app, "a1")[0] == 404


def test_metrics_count_each_adapter(setup):
    app, root, _, _ = setup
    call(app, "POST", "/v1/load_lora_adapter", {"lora_name": "m1", "lora_path": str(root / "a1")})
    # one resident slot and one host copy (max_cpu_loras defaults to max_loras): each
    # switch evicts the other adapter's copies, and a dropped host copy is read again
    for model in ("a0", "m1", "a0"):
        assert tokens(app, model)[0] == 200
    _, text = call(app, "GET", "/metrics")
    series = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line.startswith("baton:lora_")}
    assert series['baton:lora_requests_total{adapter="m1"}'] == 1
    assert series['baton:lora_tokens_total{adapter="m1",kind="generation"}'] == 5
    assert series['baton:lora_tokens_total{adapter="m1",kind="prompt"}'] == len(PROMPT)
    assert series['baton:lora_loads_total{adapter="m1",tier="host"}'] == 2
    assert series['baton:lora_evictions_total{adapter="m1",tier="host"}'] == 2
    assert series['baton:lora_loads_total{adapter="m1",tier="device"}'] == 1
    assert series['baton:lora_evictions_total{adapter="m1",tier="device"}'] == 1
    assert series['baton:lora_evictions_total{adapter="a0",tier="device"}'] >= 1
    call(app, "POST", "/v1/unload_lora_adapter", {"lora_name": "m1"})
    if shutil.which("promtool"):  # the LoRA series lint clean (but for the `:` namespace)
        r = subprocess.run(["promtool", "check", "metrics"], input=text.encode(),
                           capture_output=True, timeout=30)
        lint = [ln for ln in (r.stdout + r.stderr).decode().splitlines()
                if "lora" in ln and "should not contain ':'" not in ln]
        assert r.returncode in (0, 3) and not lint, lint


def test_a_remote_prefill_runs_the_requests_adapter(tmp_path):
    """A prefill pod computes an adapter's request with the adapter: its KV (and so the
    first token it samples and hands over) are the adapter's, not the base model's."""
    from baton.common.roles import Role

    base = tiny_base(tmp_path / "tiny")
    peft = save_adapter(base, tmp_path / "a0", seed=1, r=4)
    engine = EngineConfig.from_args(model=str(tmp_path / "tiny"), dtype="float32",
                                    num_kv_blocks=32, skip_tokenizer_init=True, max_loras=1,
                                    lora_modules=[f"a0={tmp_path / 'a0'}"],
                                    kv_transport="local", engine_id="lora-prefill")
    state = WorkerState(WorkerSettings(engine=engine, served_model_name="tiny",
                                       role=Role.PREFILL))
    state.load()
    try:
        app = build_app(state.settings, state)
        firsts = {}
        for model in ("a0", "tiny"):
            code, raw = call(app, "POST", "/internal/prefill", {"api": "completions", "request": {
                "model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}})
            assert code == 200, raw
            firsts[model] = json.loads(raw)["kv_transfer_params"]["first_token"]
            assert asyncio.run(state.engine.release_lease(
                json.loads(raw)["kv_transfer_params"]["lease_id"]))
        want = {"a0": hf_greedy(peft, [PROMPT], 1)[0][0], "tiny": hf_greedy(base, [PROMPT], 1)[0][0]}
        assert firsts == want and want["a0"] != want["tiny"]
    finally:
        state.engine.shutdown()
