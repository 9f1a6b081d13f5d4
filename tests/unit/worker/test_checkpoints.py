"""A worker over a real tiny engine: several served names (any of them routes here, the
first is reported, as vLLM's `--served-model-name a b`), and a checkpoint served without a
tokenizer (`--skip-tokenizer-init`: token-id completions work, text and chat are 400s)."""

from __future__ import annotations

import asyncio
import json

import pytest

from baton.engine.config import EngineConfig
from baton.worker.app import build_app
from baton.worker.state import WorkerSettings, WorkerState
from tests.unit.engine.tiny_checkpoint import save_tiny_llama
from tests.unit.worker.fakes import asgi_call

NAMES = ("tiny", "alias")


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    model = save_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny")
    engine = EngineConfig.from_args(model=str(model), dtype="float32", num_kv_blocks=32,
                          skip_tokenizer_init=True)
    settings = WorkerSettings(engine=engine, served_model_name=list(NAMES))
    state = WorkerState(settings)
    state.load()
    yield build_app(settings, state)
    state.engine.shutdown()


def call(app, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    code, _, raw = asyncio.run(asgi_call(app, method, path, body))
    return code, json.loads(raw)


def completion(model: str = "alias", prompt=(5, 17, 300), **extra) -> dict:
    return {"model": model, "prompt": list(prompt) if not isinstance(prompt, str) else prompt,
            "max_tokens": 4, "temperature": 0, "ignore_eos": True} | extra


def test_every_served_name_is_listed_and_answered(app):
    code, models = call(app, "GET", "/v1/models")
    assert code == 200 and [m["id"] for m in models["data"]] == list(NAMES)
    for name in NAMES:
        code, body = call(app, "POST", "/v1/completions", completion(name))
        assert code == 200, body
        assert body["model"] == "tiny"  # the primary name, whichever was asked (vLLM's)
    code, body = call(app, "POST", "/v1/completions", completion("other"))
    assert code == 404 and "'tiny', 'alias'" in body["error"]["message"]
    code, load = call(app, "GET", "/load")
    assert load["model"] == "tiny" and load["models"] == list(NAMES)
    assert (load["kv_blocks_total"], load["block_size"]) == (32, 16)  # the pool's size


def test_token_id_prompts_work_without_a_tokenizer(app):
    code, body = call(app, "POST", "/v1/completions", completion(logprobs=1))
    assert code == 200, body
    choice = body["choices"][0]
    assert choice["text"] == "" and body["usage"]["completion_tokens"] == 4
    tokens = choice["logprobs"]["tokens"]  # token texts as vLLM gives them without one
    assert len(tokens) == 4 and all(t.startswith("token_id:") for t in tokens)
    assert [int(t.split(":")[1]) for t in tokens] == [
        int(next(iter(top)).split(":")[1]) for top in choice["logprobs"]["top_logprobs"]]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", completion(prompt="hello"), "prompt"),
    ("/v1/completions", completion(prompt=["ok", "x"]), "prompt"),
    ("/v1/chat/completions", {"model": "tiny", "max_tokens": 3,
                              "messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/tokenize", {"model": "tiny", "prompt": "hello"}, "prompt"),
    ("/detokenize", {"model": "tiny", "tokens": [5, 6]}, "tokens"),
])
def test_text_needs_a_tokenizer_and_is_a_400(app, path, body, param):
    code, answer = call(app, "POST", path, body)
    assert code == 400, answer
    assert answer["error"]["param"] == param
    assert "skip-tokenizer-init" in answer["error"]["message"]


def test_stop_strings_need_a_tokenizer_too(app):
    code, answer = call(app, "POST", "/v1/completions", completion(stop=["x"]))
    assert code == 400 and answer["error"]["param"] == "stop"
    code, answer = call(app, "POST", "/v1/completions", completion(stop_token_ids=[7]))
    assert code == 200


def test_routers_get_no_tokenizer_to_fetch(app):
    code, answer = call(app, "GET", "/internal/tokenizer")
    assert code == 404 and "skip-tokenizer-init" in answer["error"]["message"]


# -- the settings ------------------------------------------------------------------------
@pytest.mark.parametrize("given, names", [
    (None, ("SmolLM2-135M-Instruct",)), ("one", ("one",)), ("", ("SmolLM2-135M-Instruct",)),
    (["a", "b"], ("a", "b")), (("a",), ("a",))])
def test_served_names_take_one_name_or_several(given, names):
    settings = WorkerSettings(served_model_name=given)
    assert settings.model_names == names and settings.model_name == names[0]


@pytest.mark.parametrize("model, name", [
    ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B"), ("hf://org/m@v2", "org/m"),
    ("/models/llama/", "llama"), ("/w/SmolLM2.Q4.gguf", "SmolLM2.Q4")])
def test_without_served_names_the_model_argument_names_it(model, name):
    assert WorkerSettings(engine=EngineConfig.from_args(model=model)).model_names == (name,)


@pytest.mark.parametrize("bad", [[], ["a", "a"], ["a", " "]])
def test_bad_served_names_are_refused(bad):
    with pytest.raises(ValueError, match="served_model_name"):
        WorkerSettings(served_model_name=bad)


def test_the_flags_reach_the_settings_and_baton_up_passes_them_on():
    from baton.cli import _worker_settings, build_parser
    from baton.cli_common import engine_config, worker_flag_args

    argv = ["serve", "--model", "org/m", "--revision", "v1", "--skip-tokenizer-init",
            "--served-model-name", "a", "b", "--max-model-len", "128"]
    args = build_parser().parse_args(argv)
    engine = engine_config(args)
    checkpoint = engine.checkpoint
    assert (checkpoint.model, checkpoint.revision, checkpoint.skip_tokenizer_init,
            checkpoint.max_model_len) == ("org/m", "v1", True, 128)
    assert _worker_settings(args, engine, frozenset()).model_names == ("a", "b")
    passed = worker_flag_args(args)  # what `baton up` gives each worker
    assert passed[passed.index("--served-model-name"):][:3] == ["--served-model-name", "a", "b"]
    again = build_parser().parse_args(["serve", *passed])
    assert engine_config(again) == engine and worker_flag_args(again) == passed
