"""Invalid configuration and sampling parameters name the field and the accepted range."""

from __future__ import annotations

import pytest

from baton.common.sampling_params import SamplingParams
from baton.engine.config import EngineConfig


@pytest.mark.parametrize("kwargs,field", [
    ({"block_size": 12}, "block_size"), ({"dtype": "int8"}, "dtype"),
    ({"max_num_seqs": 0}, "max_num_seqs"), ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ({"num_kv_blocks": 0}, "num_kv_blocks"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization"),
    ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes"),
])
def test_engine_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
        EngineConfig.from_args(**kwargs)


def test_gpu_memory_utilization_takes_the_fraction_of_the_device():
    assert EngineConfig.from_args(
        gpu_memory_utilization=1.0).cache.gpu_memory_utilization == 1.0
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=-0.5 must be None or in "
                                         r"\(0, 1\]"):
        EngineConfig.from_args(gpu_memory_utilization=-0.5)


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"logprobs": -1}, "logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"stop": [""]}, "stop"), ({"n": 0}, "n"),
])
def test_sampling_params_reject_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_vllm_conventions():
    p = SamplingParams(top_k=-1, stop="###", temperature=0)
    assert p.top_k == 0 and p.stop == ["###"] and p.is_greedy
