"""The loader's host memory: a checkpoint of several shards is read shard by shard, tensor by
tensor, into weights already on the target device, so the host's peak grows by about one
shard, never the whole checkpoint.

Measured in a fresh process with Linux's peak RSS (VmHWM), reset (`/proc/self/clear_refs`)
once the model's own memory is in place: on CPU the target device is host memory, so only
what loading adds on top of the weights is counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

MEASURE = r"""
import gc, json, sys
from pathlib import Path
import torch
from baton.engine.models.config import ModelConfig
from baton.engine.models.loader import checkpoint_files, checkpoint_tensors, materialise
from baton.engine.models.registry import model_class

def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024

model_dir = Path(sys.argv[1])
cfg = ModelConfig.from_dir(model_dir)
with torch.device("meta"):
    model = model_class(cfg.architecture)(cfg, 128)
model = materialise(model, torch.float32, torch.device("cpu"))
with torch.no_grad():
    for p in model.parameters():
        p.fill_(0.0)  # the weights' pages resident before the peak is reset
next(checkpoint_tensors(model_dir))  # safetensors' own first-use setup
gc.collect()
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
base = status("VmRSS")
model.load_weights(checkpoint_tensors(model_dir))
peak = status("VmHWM")
assert all(bool(p.abs().sum() > 0) for n, p in model.named_parameters() if "norm" not in n)
print(json.dumps({"growth": peak - base,
                  "shards": [f.stat().st_size for f in checkpoint_files(model_dir)]}))
"""


def _save_sharded_llama(path: Path) -> Path:
    """A random float32 Llama of ~40 MB in shards of at most 8 MB."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1024,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).eval().save_pretrained(path, max_shard_size="8MB")
    return path


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux peak RSS")
def test_loading_a_sharded_checkpoint_holds_about_one_shard_on_the_host(tmp_path):
    model_dir = _save_sharded_llama(tmp_path / "m")
    out = subprocess.run([sys.executable, "-c", MEASURE, str(model_dir)], capture_output=True,
                         text=True, timeout=300, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    shards, growth = result["shards"], result["growth"]
    assert len(shards) >= 4
    # one shard mapped plus the tensor being copied, with allocator slack; the whole
    # checkpoint would be sum(shards)
    assert growth <= 1.5 * max(shards) + (4 << 20), (growth, shards)
    assert growth < sum(shards) / 2, (growth, shards)
