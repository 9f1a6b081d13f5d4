"""The host offload tier on the real model: a conversation whose prefix the small device pool
evicted is served from the tier (prefill computes only the rest), greedy tokens equal an
engine without the tier, preemption still works, and no block leaks."""

from __future__ import annotations

import pytest

from baton import LLM, SamplingParams
from tests.conftest import make_text

pytestmark = pytest.mark.slow

BLOCK = 16
ENGINE = dict(dtype="float32", num_kv_blocks=40, block_size=BLOCK, max_model_len=640)
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def texts(tokenizer):
    """A first turn, two unrelated prompts that turn the device pool over, a follow-up."""
    return {"turn1": tokenizer.encode(make_text(4, 0)),
            "other": [tokenizer.encode(make_text(12, k))[:560] for k in (5, 9)],
            "more": tokenizer.encode("\n\nNow say it again, shorter.")}


def converse(llm: LLM, texts) -> tuple[list[list[int]], list[int], list[int]]:
    """Turn 1, two other prompts, turn 2 (turn 1 + its answer + more): every output's
    tokens, turn 2's cached tokens and the prompt tokens the engine computed for it."""
    first = llm.generate([texts["turn1"]], GREEDY, use_tqdm=False)[0]
    answers = [list(first.outputs[0].token_ids)]
    for ids in texts["other"]:
        answers.append(list(llm.generate([ids], GREEDY, use_tqdm=False)[0]
                            .outputs[0].token_ids))
    prompt2 = texts["turn1"] + answers[0] + texts["more"]
    before = llm.engine.stats.prompt_tokens_total
    second = llm.generate([prompt2], GREEDY, use_tqdm=False)[0]
    answers.append(list(second.outputs[0].token_ids))
    computed = llm.engine.stats.prompt_tokens_total - before
    return answers, [second.num_cached_tokens, len(prompt2)], [computed]


@pytest.fixture(scope="module")
def plain(texts):
    return converse(LLM(**ENGINE), texts)


def test_an_evicted_prefix_is_served_from_the_host_tier(texts, plain):
    llm = LLM(**ENGINE, kv_offload_gib=0.1)
    answers, (cached, num_prompt), (computed,) = converse(llm, texts)
    assert answers == plain[0]  # greedy: the tier changes no token
    assert plain[1][0] == 0  # without the tier the device pool lost turn 1
    # Turn 1's prompt and the answer tokens whose KV it computed, in whole blocks
    num_turn1 = len(texts["turn1"]) + len(answers[0]) - 1
    assert cached == num_turn1 // BLOCK * BLOCK
    assert computed == num_prompt - cached  # prefill computed only the rest
    tier = llm.engine.metrics_snapshot().kv_tier
    assert tier is not None and tier.hit_tokens_total == cached
    assert tier.hit_blocks_total * BLOCK == cached
    assert tier.loaded_bytes_total > 0 and tier.offloaded_bytes_total > 0
    assert 0 < tier.blocks_held <= tier.blocks_total
    llm.engine.check_integrity()
    assert llm.engine.kv.num_used_blocks == 0


def test_the_tier_holds_at_most_its_size(texts):
    llm = LLM(**ENGINE, kv_offload_gib=6 * 737_280 / (1 << 30))  # 6 float32 blocks
    converse(llm, texts)
    tier = llm.engine.metrics_snapshot().kv_tier
    assert tier is not None and tier.blocks_total == 6 and tier.blocks_held == 6
    assert tier.offloaded_bytes_total > 6 * 737_280  # it evicted to take more
    llm.engine.check_integrity()


def test_preemption_with_the_tier_keeps_greedy_tokens(texts):
    prompts = [texts["turn1"], *texts["other"], texts["turn1"] + texts["more"]]
    params = SamplingParams(temperature=0, max_tokens=24)
    args = ENGINE | dict(num_kv_blocks=48, max_model_len=720)
    want = [o.outputs[0].token_ids for o in LLM(**args).generate(prompts, params,
                                                                  use_tqdm=False)]
    llm = LLM(**args, kv_offload_gib=0.1)
    for _ in range(2):  # the second round finds the first's blocks in the tier
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.metrics_snapshot().kv_tier.hit_blocks_total > 0
    llm.engine.check_integrity()


def test_the_tier_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match="kv_offload_gib"):
        LLM(**ENGINE, kv_offload_gib=-1)
    with pytest.raises(ValueError, match="prefix caching"):
        LLM(**ENGINE, kv_offload_gib=0.1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="holds no KV block"):
        LLM(**ENGINE, kv_offload_gib=1e-9)


def test_a_restarted_engine_serves_the_next_turn_from_the_disk_tier(texts, plain, tmp_path):
    disk = dict(kv_offload_gib=0.1, kv_disk_dir=str(tmp_path), kv_disk_gib=0.1)
    first = LLM(**ENGINE, **disk)
    answer = list(first.generate([texts["turn1"]], GREEDY, use_tqdm=False)[0]
                  .outputs[0].token_ids)
    assert answer == plain[0][0]
    first.engine.close()  # a graceful stop writes the host tier to disk
    again = LLM(**ENGINE, **disk)
    prompt2 = texts["turn1"] + answer + texts["more"]
    out = again.generate([prompt2], GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == plain[0][-1]  # turn 2 as without any tier
    num_turn1 = len(texts["turn1"]) + len(answer) - 1
    assert out.num_cached_tokens == num_turn1 // BLOCK * BLOCK  # all read from disk
    tier = again.engine.metrics_snapshot().kv_tier
    assert tier is not None and tier.disk_read_blocks_total == num_turn1 // BLOCK
    again.engine.check_integrity()


def test_a_damaged_disk_block_is_computed_again_with_the_same_tokens(texts, plain, tmp_path):
    disk = dict(kv_offload_gib=0.1, kv_disk_dir=str(tmp_path), kv_disk_gib=0.1)
    first = LLM(**ENGINE, **disk)
    answer = list(first.generate([texts["turn1"]], GREEDY, use_tqdm=False)[0]
                  .outputs[0].token_ids)
    first.engine.close()
    worker = first.engine.connector.host.io
    assert worker is not None and worker.stopped  # the disk tier's thread ends with it
    again = LLM(**ENGINE, **disk)
    prompt2 = texts["turn1"] + answer + texts["more"]
    probe = again.engine.make_request("probe", prompt2, GREEDY)
    again.engine.kv.get_computed_blocks(probe)  # computes its block hashes
    (path,) = tmp_path.glob(f"*/{probe.block_hashes[2]:016x}.kv")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55  # one bit pattern flipped in block 2's payload
    path.write_bytes(bytes(data))
    out = again.generate([prompt2], GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == plain[0][-1]  # as without any tier
    assert out.num_cached_tokens == 2 * BLOCK  # blocks 0 and 1; from 2 on, computed
    tier = again.engine.metrics_snapshot().kv_tier
    assert tier is not None and tier.load_fallbacks_total == 1
    assert tier.disk_read_failures_total == 1 and not path.exists()
    again.engine.check_integrity()
    assert again.engine.kv.num_used_blocks == 0
    again.engine.close()


def test_the_disk_tier_needs_the_host_tier_and_a_size(tmp_path):
    with pytest.raises(ValueError, match="kv_disk_gib"):
        LLM(**ENGINE, kv_disk_dir=str(tmp_path), kv_disk_gib=0.1)
    with pytest.raises(ValueError, match="kv_disk_gib"):
        LLM(**ENGINE, kv_offload_gib=0.1, kv_disk_dir=str(tmp_path))
