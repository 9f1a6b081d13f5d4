"""The simulated device (`engine.sim`): profiles load and are checked, the roofline gives
hand-checked step times, the device is asynchronous (launch returns at once, reading waits
for the modelled end), and an engine on it serves requests to their exact lengths while
reporting how busy it kept the device."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from baton import LLM, SamplingParams
from baton.common.step_timing import StepTiming
from baton.engine.config import EngineConfig
from baton.engine.sim.device import SimDevice
from baton.engine.sim.profile import SimProfile, available, load_profile
from baton.engine.sim.roofline import StepRow, step_seconds

H100 = load_profile("h100-llama3-8b")


def test_bundled_profiles_load_and_bad_ones_are_named(tmp_path):
    assert {"h100-llama3-8b", "h200-llama3-8b", "h100-llama3.2-1b"} <= set(available())
    m = H100.model
    assert m.layer_params + m.head_params + m.vocab_size * m.hidden_size == pytest.approx(
        8.03e9, rel=0.01)  # Llama-3-8B: blocks, lm_head and the embedding
    small = load_profile("h100-llama3.2-1b").model
    assert small.layer_params + small.head_params == pytest.approx(
        1.24e9, rel=0.01)  # Llama-3.2-1B: blocks and the tied embedding
    with pytest.raises(ValueError, match="neither a file nor one of .*h100-llama3-8b"):
        load_profile("a100-nothing")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ndevice: {name: d, memory_gib: 80, memory_bandwidth_gbs: 0, "
                   "peak_tflops: 1, launch_us: 1}\nmodel: {name: m}\n")
    with pytest.raises(ValueError, match="missing 1 required|num_layers"):
        load_profile(str(bad))
    raw = {"name": "x", "device": {"name": "d", "memory_gib": 80, "memory_bandwidth_gbs": 0,
                                   "peak_tflops": 1, "launch_us": 1, "colour": "red"},
           "model": {}}
    with pytest.raises(ValueError, match="unknown field 'colour'"):
        SimProfile.from_dict(raw, "inline")


def test_a_decode_step_is_bound_by_bytes_and_a_prefill_chunk_by_flops():
    m, d = H100.model, H100.device
    launch = d.launch_us * 1e-6
    one = step_seconds(H100, [StepRow(1, 1023, 1)])
    weights_and_kv = m.weight_bytes_total + 1024 * m.kv_bytes_per_token
    assert one == pytest.approx(weights_and_kv / (d.memory_bandwidth_gbs * 1e9) + launch)
    assert 4e-3 < one < 7e-3  # ~5 ms: an 8B decode step at batch 1 on an H100
    batch = step_seconds(H100, [StepRow(1, 1023, 1)] * 256)
    assert 12e-3 < batch < 20e-3  # ~16 ms at batch 256, 1k context
    chunk = step_seconds(H100, [StepRow(2048, 0, 1)])
    flops = (2 * m.layer_params * 2048 + 2 * m.head_params
             + 4 * m.num_layers * m.num_heads * m.head_dim * 2048 * 2049 // 2)
    assert chunk == pytest.approx(flops / (d.peak_tflops * 1e12) + launch)
    assert step_seconds(H100, []) == 0.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        self.now += 1e-6  # reading the clock takes a microsecond
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_launch_returns_at_once_and_reading_waits_for_the_modelled_end():
    clock = FakeClock()
    device = SimDevice(clock, clock.sleep)
    done = device.launch(0.005)
    assert done == pytest.approx(100.005, abs=1e-5) and clock.slept == []
    clock.now += 0.002  # host work overlapping the step is free
    device.wait(done)
    assert clock.now >= done and clock.now - done < 1e-4
    second = device.launch(0.003)  # queued after the first
    assert second >= done + 0.003
    assert device.busy_s == pytest.approx(0.005, abs=1e-4)  # the queued step counts as it runs
    device.wait(second)
    assert device.busy_s == pytest.approx(0.008)
    clock.now += 1.0  # idle: nothing more counts
    assert device.busy_s == pytest.approx(0.008)


def test_sim_profile_goes_with_the_sim_device():
    with pytest.raises(ValueError, match="sim_profile"):
        EngineConfig.from_args(device="sim")
    with pytest.raises(ValueError, match="sim_profile"):
        EngineConfig.from_args(device="cpu", sim_profile="h100-llama3-8b")
    with pytest.raises(ValueError, match="offload tiers are not simulated"):
        LLM(device="sim", sim_profile="h100-llama3-8b", kv_offload_gib=1)


def test_an_engine_on_the_sim_device_serves_exact_lengths_and_reports_busy_time():
    llm = LLM(device="sim", sim_profile="h100-llama3-8b", max_num_seqs=16)
    prompts = [{"prompt_token_ids": [100 + i + j for j in range(300)]} for i in range(8)]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=20 + i) for i in range(8)],
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [20 + i for i in range(8)]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    timing = llm.engine.timing
    assert timing.steps >= 27 and 0.5 < timing.busy_fraction <= 1.0
    # each step is timed when read (as by CUDA events); the engine's timing takes a read at
    # its next step, so the last steps, read by calls that launched nothing, are still to come
    runner = llm.engine.runner
    assert 0 <= runner.busy_seconds - timing.device_s < 0.05
    assert runner.device.busy_s == pytest.approx(runner.busy_seconds)  # none in flight
    llm.engine.kv.check_integrity()


def test_step_timing_renders_as_prometheus_series():
    timing = StepTiming()
    timing.record(0.010, 0.009)
    timing.record(0.010, 0.006)

    class One:
        def collect(self):
            return timing.families()

    registry = CollectorRegistry()
    registry.register(One())
    text = generate_latest(registry).decode()
    assert "baton:engine_device_busy_seconds_total 0.015" in text
    assert 'baton:engine_step_host_seconds_bucket{le="0.002"} 1.0' in text
    assert 'baton:engine_step_host_seconds_bucket{le="0.005"} 2.0' in text
    assert timing.busy_fraction == pytest.approx(0.75)


def test_a_disaggregated_pair_on_the_sim_device_pulls_kv_and_decodes_asynchronously():
    import time

    from baton.engine.core import EngineCore
    from baton.engine.kv_connector import HoldKV, PullKV

    def core(role: str) -> EngineCore:
        return EngineCore(EngineConfig.from_args(
            device="sim", sim_profile="h100-llama3-8b", kv_transport="local",
            engine_id=f"sim-{role}-{time.monotonic_ns()}", num_kv_blocks=256))

    p, d = core("prefill"), core("decode")
    try:
        prompt = [100 + i % 500 for i in range(700)]
        p.add(p.make_request("a", prompt, SamplingParams(max_tokens=1), kv=HoldKV()))
        final = None
        while final is None:
            final = next((o for o in p.step() if o.finished), None)
        assert final.kv_transfer_params is not None and p.kv.num_used_blocks == 44
        assert d.async_scheduling
        tokens = [t for o in d.add(d.make_request("a", prompt, SamplingParams(max_tokens=12),
                                                  kv=PullKV(final.kv_transfer_params)))
                  for t in o.new_token_ids]
        deadline = time.monotonic() + 30
        while d.has_unfinished_requests() and time.monotonic() < deadline:
            tokens += [t for o in d.step() for t in o.new_token_ids]
            time.sleep(0.001)
        assert len(tokens) == 12 and tokens[0] == final.new_token_ids[0]
        assert d.connector.kv_stats().bytes_total == 44 * 16 * 2 * 8 * 2  # the stand-in's
        assert d.metrics_snapshot().prompt_tokens_total == 0  # pulled, not prefilled
        deadline = time.monotonic() + 5
        while p.kv.num_used_blocks and time.monotonic() < deadline:  # the lease ends
            p.step()
            time.sleep(0.01)
        assert p.kv.num_used_blocks == 0 and d.kv.num_used_blocks == 0
    finally:
        p.close()
        d.close()
