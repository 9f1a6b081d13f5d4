"""The engine's `triton` attention backend and its decode replays (the CUDA-graph path with
static, padded buffers). On CPU the kernels run in triton's interpreter and the replays run
eagerly over the same static buffers; on a GPU the same tests run on CUDA with real graphs.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.attention import make_attention_backend
from baton.engine.attention.torch_backend import TorchAttentionBackend
from baton.engine.attention.triton_backend import TritonAttentionBackend
from baton.engine.runner.cuda_graphs import capture_sizes, padded_size
from baton_kernels import recording_variants
from tests.kernels.conftest import ON_GPU
from tests.unit.engine.test_attention import make_case

DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_backend_matches_torch_backend_on_a_mixed_batch(dtype, tol):
    # 5 decodes (lengths 1 .. 38) then 3 prefill chunks, one with cached context.
    q, k, v, k_cache, v_cache, layout, _ = make_case(dtype, seed=3, D=64)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    torch_backend = TorchAttentionBackend(dtype)
    ref = torch_backend.forward(q, k, v, ref_k, ref_v, torch_backend.build_metadata(layout))

    dev = torch.device(DEVICE)
    layout.block_tables, layout.slot_mapping = (layout.block_tables.to(dev),
                                                layout.slot_mapping.to(dev))
    k_cache, v_cache = k_cache.to(dev), v_cache.to(dev)
    backend = TritonAttentionBackend(dtype)
    out = backend.forward(q.to(dev), k.to(dev), v.to(dev), k_cache, v_cache,
                          backend.build_metadata(layout))
    assert torch.equal(k_cache.cpu(), ref_k) and torch.equal(v_cache.cpu(), ref_v)
    assert (out.cpu().float() - ref.float()).abs().max().item() < tol


def test_backend_choice(tmp_path):
    cpu = torch.device("cpu")
    shape = (4, 2, 64)
    assert make_attention_backend("auto", cpu, torch.float32, shape, tmp_path).name == "torch"
    # The interpreter is on in these tests (conftest), so triton is allowed on CPU.
    if not ON_GPU:
        assert make_attention_backend("triton", cpu, torch.float32, shape, None).name == "triton"
    else:
        gpu = torch.device("cuda")
        assert make_attention_backend("auto", gpu, torch.float32, shape, None).name == "triton"
    with pytest.raises(ValueError, match="unknown"):
        make_attention_backend("flash", cpu, torch.float32, shape, None)


def test_triton_backend_keeps_compiled_kernels_under_the_cache_dir(tmp_path, monkeypatch):
    import os

    import triton

    dev = torch.device(DEVICE)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    make_attention_backend("triton", dev, torch.float32, (4, 2, 64), tmp_path)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    assert triton.knobs.cache.dir == str(tmp_path / "triton")  # read at each compile
    # A directory the user chose wins.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    make_attention_backend("triton", dev, torch.float32, (4, 2, 64), tmp_path / "engine")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        make_attention_backend("triton", torch.device("cpu"), torch.float32, (4, 2, 64), None)


def test_capture_sizes_and_padding():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(1024)[-3:] == [224, 240, 256]
    sizes = capture_sizes(40)
    assert [padded_size(n, sizes) for n in (1, 3, 9, 33, 40, 41)] == [1, 4, 16, 40, 40, None]


def save_tiny_llama(path, model_dir) -> None:
    """Random Llama, head dim 64 (a size the kernels support), 2 layers, GQA 2:1."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights so greedy paths are not all one token
        for p in model.parameters():
            p.mul_(8.0 if p.dim() > 1 else 1.0)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, path / name)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, model_dir):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path, model_dir)
    return str(path)


def _generate(llm: LLM) -> list[list[int]]:
    # Three prompts with different output lengths: the decode batch goes 3 -> 2 -> 1, so
    # replays run padded (3 rows in the size-4 buffers) and unpadded. One prompt crosses a
    # block boundary while decoding (block size 16).
    prompts = [[5 + 7 * i + j for j in range(n)] for i, n in enumerate((5, 14, 40))]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (9, 6, 4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_engine_triton_backend_and_decode_replays_match_torch(tiny_model):
    kw = dict(dtype="float32", block_size=16, max_num_batched_tokens=32, max_num_seqs=8,
              device=DEVICE)
    expected = _generate(LLM(tiny_model, attention_backend="torch", enforce_eager=True, **kw))
    assert len({t for r in expected for t in r}) > 3

    eager = LLM(tiny_model, attention_backend="triton", enforce_eager=True, **kw)
    runner = eager.engine.runner
    assert runner.backend.name == "triton" and runner.platform.fast_decode is None
    # What ModelRunner does on CUDA at start (here too, to see the variants in the
    # interpreter): every kernel variant launched once. Serving then launches no other.
    with recording_variants() as warmed:
        runner.backend.warmup(*runner.kv_caches[0], runner.model.attention_specs(), 4)
    with recording_variants() as used:
        assert _generate(eager) == expected

    replayed = LLM(tiny_model, attention_backend="triton", **kw)
    runner = replayed.engine.runner
    graphs = runner.platform.fast_decode
    if graphs is None:  # CPU: no CUDA graphs, replay the static buffers eagerly
        graphs = runner.platform.fast_decode = runner.make_decode_graphs(use_graphs=False)
        graphs.capture()
    assert graphs.sizes == [1, 2, 4, 8]
    with recording_variants() as replayed_used:
        assert _generate(replayed) == expected
    assert used and used | replayed_used <= warmed, (used | replayed_used) - warmed
    # All-decode steps ran 3 rows padded to 4, then 2, then 1.
    assert set(graphs.replays) == {1, 2, 4}
    replayed.engine.kv.check_integrity()


class RecordingModel(torch.nn.Module):
    """Stands in for the model behind its forward interface: records what each replay's
    attention metadata holds and returns the token ids as 'hidden states'."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, input_ids, positions, ctx):
        m = ctx.metadata
        self.seen.append((m.slot_mapping.tolist(), m.decode.seq_lens.tolist()))
        return input_ids[:, None].float()


def test_replays_reset_padding_rows_between_steps():
    from baton.engine.attention.base import BatchLayout
    from baton.engine.runner.batch import FlatBatch
    from baton.engine.runner.cuda_graphs import DecodeGraphs

    model = RecordingModel()
    graphs = DecodeGraphs(model, TritonAttentionBackend(torch.float32), [], [1, 2, 4], 8,
                          torch.device("cpu"), use_graphs=False)
    graphs.capture()
    assert [lens for _, lens in model.seen] == [[0] * 4, [0] * 2, [0]]  # capture: all padding

    def decode_batch(n):
        lens = [20 + i for i in range(n)]
        layout = BatchLayout(list(range(n + 1)), [x - 1 for x in lens], lens, n,
                             torch.arange(n * 2).view(n, 2), torch.tensor(lens) + 100, 16)
        return FlatBatch(torch.arange(7, 7 + n), torch.tensor(lens) - 1, layout, [], [], [])

    model.seen.clear()
    assert graphs.run(decode_batch(4)).squeeze(1).tolist() == [7, 8, 9, 10]
    assert graphs.run(decode_batch(3)).squeeze(1).tolist() == [7, 8, 9]
    # The fourth row of the size-4 buffers held a real sequence a step ago: now padding.
    assert model.seen[1] == ([120, 121, 122, -1], [20, 21, 22, 0])
    assert graphs.replays == {4: 2}
    assert not graphs.can_run(FlatBatch(*[None] * 2, BatchLayout(
        [0, 1, 3], [5, 0], [6, 2], 1, torch.zeros(2, 1), torch.zeros(3), 16), [], [], []))
