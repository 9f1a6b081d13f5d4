"""Checkpoints as people have them: sharded safetensors, no tokenizer
(`skip_tokenizer_init`), a Hugging Face repo id read from the local hub cache (offline, no
socket opened), and a context window the KV pool bounds."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket

import pytest
import torch

from baton import LLM, SamplingParams
from baton.common.sampling_params import StructuredOutput
from baton.engine.errors import InvalidRequestError
from tests.unit.engine.tiny_checkpoint import MAX_POSITIONS, VOCAB, save_tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
PROMPTS = [[5, 17, 300, 42], list(range(10, 70)), [999, 1, 2]]
TINY = dict(dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same random model saved whole and in several shards."""
    root = tmp_path_factory.mktemp("ckpt")
    return (save_tiny_llama(root / "whole"),
            save_tiny_llama(root / "sharded", max_shard_size="100KB"))


def run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
            for o in outs]


# -- sharded safetensors -------------------------------------------------------------------
def test_a_sharded_checkpoint_loads_and_matches_the_whole_one(checkpoints):
    whole, sharded = checkpoints
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # really several shards
    assert not (sharded / "model.safetensors").exists()
    a, b = LLM(str(whole), **TINY), LLM(str(sharded), **TINY)
    wa, wb = a.engine.runner.model.state_dict(), b.engine.runner.model.state_dict()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert run(a) == run(b)


def test_a_bin_only_checkpoint_is_refused(checkpoints, tmp_path):
    whole = checkpoints[0]
    shutil.copy(whole / "config.json", tmp_path / "config.json")
    from safetensors.torch import load_file

    torch.save(load_file(whole / "model.safetensors"), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"PyTorch \.bin weights only; Baton loads "
                                         r"safetensors.*save_pretrained"):
        LLM(str(tmp_path), **TINY)


def test_an_index_naming_a_missing_shard_is_a_clear_error(checkpoints, tmp_path):
    shard_dir = tmp_path / "sharded"
    shutil.copytree(checkpoints[1], shard_dir)
    gone = sorted(shard_dir.glob("model-*.safetensors"))[2]
    gone.unlink()
    with pytest.raises(FileNotFoundError, match=f"lists shards it does not hold.*{gone.name}"):
        LLM(str(shard_dir), **TINY)


# -- no tokenizer ---------------------------------------------------------------------------
def test_no_tokenizer_files_without_the_flag_suggests_it(checkpoints):
    with pytest.raises(FileNotFoundError, match=r"holds no tokenizer.*--skip-tokenizer-init"):
        LLM(str(checkpoints[0]), dtype="float32", num_kv_blocks=64)


def test_skip_tokenizer_init_serves_token_ids_only(checkpoints):
    llm = LLM(str(checkpoints[0]), **TINY)
    assert llm.get_tokenizer() is None
    assert llm.engine.eos_token_id == 2  # from config.json, there being no tokenizer
    out = llm.generate([[5, 17, 300]], GREEDY, use_tqdm=False)[0]
    assert out.prompt is None and out.prompt_token_ids == [5, 17, 300]
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="a text prompt needs a tokenizer.*skip_tokenizer_init"):
        llm.generate("hello", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="chat .*needs a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="stop strings") as err:
        llm.generate([[5, 6]], SamplingParams(max_tokens=3, stop=["x"]), use_tqdm=False)
    assert err.value.param == "stop"
    regex = SamplingParams(max_tokens=3, structured=StructuredOutput("regex", "[0-9]+"))
    with pytest.raises(InvalidRequestError, match="no tokenizer") as err:
        llm.generate([[5, 6]], regex, use_tqdm=False)
    assert err.value.param == "response_format"
    # stop token ids need no text
    stopped = llm.generate([[5, 17, 300]], SamplingParams(
        temperature=0, max_tokens=8, stop_token_ids=[out.outputs[0].token_ids[2]]),
        use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == out.outputs[0].token_ids[:3] and stopped.finish_reason == "stop"


# -- the context window and the KV pool -------------------------------------------------------
def test_the_default_context_is_lowered_to_what_the_pool_holds(checkpoints, caplog):
    with caplog.at_level(logging.WARNING, logger="baton.engine.context_window"):
        llm = LLM(str(checkpoints[0]), **TINY | dict(num_kv_blocks=4, block_size=16))
    assert llm.engine.max_model_len == 64 < MAX_POSITIONS
    assert "context length 512 does not fit the KV pool" in caplog.text
    assert "lowered to 64" in caplog.text
    with pytest.raises(InvalidRequestError, match="maximum context length is 64 tokens"):
        llm.generate([list(range(3, 67))], GREEDY, use_tqdm=False)


def test_an_asked_context_longer_than_the_pool_names_both_numbers(checkpoints):
    with pytest.raises(ValueError, match=r"max_model_len=128 does not fit the KV pool.*"
                                         r"needs 8 blocks.*holds 4 \(64 tokens\)"):
        LLM(str(checkpoints[0]), **TINY | dict(num_kv_blocks=4, max_model_len=128))
    fits = LLM(str(checkpoints[0]), **TINY | dict(num_kv_blocks=4, max_model_len=48))
    assert fits.engine.max_model_len == 48


def test_the_default_context_is_the_models_when_the_pool_holds_it(checkpoints):
    assert LLM(str(checkpoints[0]), **TINY).engine.max_model_len == MAX_POSITIONS
    with pytest.raises(ValueError, match="max_model_len=1024 exceeds the model's"):
        LLM(str(checkpoints[0]), **TINY | dict(max_model_len=1024))


# -- a repo id from the local hub cache ----------------------------------------------------
def hub_cache(root, model_dir, repo_id="org/tiny-llama"):
    """`model_dir` laid out as huggingface_hub caches it: files are links into blobs/,
    `main` and tag `v1` point at COMMIT; OLD is a snapshot with other weights."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    for commit, seed in ((COMMIT, 0), (OLD, 1)):
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        src = model_dir if seed == 0 else save_tiny_llama(root / "old-src", seed=seed)
        for f in src.iterdir():
            blob = repo / "blobs" / f"{commit[:8]}-{f.name}"
            blob.parent.mkdir(exist_ok=True)
            shutil.copy(f, blob)
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v1").write_text(COMMIT)
    return repo


@pytest.fixture
def no_network(monkeypatch):
    """Every outbound connection attempt is recorded and refused; the hub's own offline
    switch is off, so only our code keeps it from the network."""
    attempts = []

    def refuse(self, address, *args):
        attempts.append(address)
        raise OSError(f"test: no network ({address})")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return attempts


def test_a_repo_id_loads_from_the_hub_cache_offline(checkpoints, tmp_path, monkeypatch,
                                                    no_network):
    hub_cache(tmp_path / "hub", checkpoints[0])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)  # no ./org/tiny-llama here
    main = LLM("org/tiny-llama", **TINY)
    assert main.engine.model_dir == tmp_path / "hub/models--org--tiny-llama/snapshots" / COMMIT
    tagged = LLM("org/tiny-llama", revision="v1", **TINY)
    assert tagged.engine.model_dir == main.engine.model_dir
    old = LLM("org/tiny-llama", revision=OLD, **TINY)
    assert old.engine.model_dir.name == OLD
    assert run(tagged) == run(main) != run(old)  # the other snapshot's weights
    assert LLM("hf://org/tiny-llama@v1", **TINY).engine.model_dir == main.engine.model_dir
    assert no_network == []


def test_a_missing_repo_names_every_place_looked_and_never_downloads(tmp_path, monkeypatch,
                                                                     no_network):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        LLM("Qwen/Qwen3-0.6B", **TINY)
    msg = str(err.value)
    assert str(tmp_path / "Qwen/Qwen3-0.6B") in msg  # as a local path
    assert str(tmp_path / "hf-home/hub/models--Qwen--Qwen3-0.6B") in msg  # in the cache
    assert "$HF_HOME/hub" in msg and "never downloads" in msg
    assert "hub download Qwen/Qwen3-0.6B --revision main" in msg
    assert no_network == []


def test_a_missing_revision_of_a_cached_repo_is_named(checkpoints, tmp_path, monkeypatch,
                                                      no_network):
    hub_cache(tmp_path, checkpoints[0])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"revision 'v9'.*refs: \['main', 'v1'\].*"
                                                r"never downloads"):
        LLM("org/tiny-llama", revision="v9", **TINY)
    with pytest.raises(ValueError, match="pins revision 'v1' but revision='v2'"):
        LLM("hf://org/tiny-llama@v1", revision="v2", **TINY)
    assert no_network == []


def test_a_local_directory_wins_over_a_repo_id(checkpoints, tmp_path, monkeypatch):
    local = tmp_path / "org" / "tiny-llama"
    shutil.copytree(checkpoints[0], local)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.chdir(tmp_path)
    assert LLM("org/tiny-llama", **TINY).engine.model_dir.resolve() == local.resolve()


def test_the_vocabulary_bounds_token_prompts(checkpoints):
    llm = LLM(str(checkpoints[0]), **TINY)
    with pytest.raises(InvalidRequestError, match=f"outside \\[0, {VOCAB}\\)"):
        llm.generate([[VOCAB]], GREEDY, use_tqdm=False)
