"""`baton up --device cuda`: which GPUs each worker gets and how much of a shared one."""

from __future__ import annotations

import pytest

from baton.gpus import plan_gpus, visible_gpus
from baton.launch import Cluster


def test_visible_gpus_from_the_environment(monkeypatch):
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0, 3"}) == ["0", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi: no GPU
    assert visible_gpus({}) == []


def test_a_gpu_per_rank_when_there_are_enough():
    plan = plan_gpus([1, 2], ["0", "1", "2", "3"], [])
    assert plan.devices == [["0"], ["1", "2"]]
    assert not plan.shared and plan.fraction is None and plan.args() == []
    assert plan.env(1) == {"CUDA_VISIBLE_DEVICES": "1,2"}


def test_workers_share_one_gpu_and_split_the_default_fraction():
    plan = plan_gpus([1, 1], ["0"], [])
    assert plan.devices == [["0"], ["0"]] and plan.shared
    assert plan.args() == ["--gpu-memory-utilization", "0.45"]
    # a pool size the user gave is theirs: no fraction added
    for flags in (["--gpu-memory-utilization", "0.4"], ["--kv-cache-gib", "8"],
                  ["--num-kv-blocks", "100"]):
        assert plan_gpus([1, 1], ["0"], flags).args() == []
    assert plan_gpus([1, 1, 1], ["0", "1"], []).fraction == 0.3  # three on the first GPU


def test_too_few_gpus_is_a_clear_error():
    with pytest.raises(ValueError, match="2 tensor-parallel ranks needs as many GPUs; 1"):
        plan_gpus([2, 1], ["0"], [])
    with pytest.raises(ValueError, match="no GPU visible"):
        plan_gpus([1], [], [])


def test_baton_up_on_cuda_without_a_gpu_exits_1_at_once(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cluster = Cluster(port=0, num_workers=1, worker_args=["--device", "cuda"])
    assert cluster.run() == 1
    assert "no GPU visible" in capsys.readouterr().err
    assert cluster.procs == []  # nothing was started
