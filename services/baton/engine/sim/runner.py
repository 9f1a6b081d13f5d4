"""`SimRunner`: the model runner's interface (`execute`, the KV pool's size, the model's
config) over a simulated device. The host builds each step's batch as the model runner
does, and the step's time is modelled from that batch's rows (`roofline.layout_seconds`),
launched, and waited for only when its tokens are read; the tokens are drawn from a seeded
generator over the tokenizer's vocabulary, never EOS, so each request runs to its
`max_tokens` (or a stop string its nonsense happens to contain).
Guesses (`engine.spec`) are verified as rows and always rejected; no logprobs are produced.

The tokenizer (and its vocabulary, EOS, chat template) is the checkpoint's `--model` (the
bundled model by default); the device's cost is the profile's model (`--sim-profile`).
A disaggregated engine (a KV transport) holds a stand-in KV cache whose blocks the
transports move for real; a pull's time is loopback's for those bytes, not modelled."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from baton.engine.distributed import TPGroup
from baton.engine.models.config import ModelConfig
from baton.engine.runner.batch import build_batch
from baton.engine.runner.step_result import StepResult
from baton.engine.sampler import Sampler
from baton.engine.scheduler.output import SchedulerOutput
from baton.engine.sim.device import SimDevice
from baton.engine.sim.profile import load_profile
from baton.engine.sim.roofline import layout_seconds
from baton.engine.spec.rejection import RejectionSampler
from baton.engine.staging import HostStaging

_HOST = torch.device("cpu")  # the batch is built on the host; the simulated device has none


class SimStep:
    """A launched step: `result()` waits for its modelled end, then reads its tokens."""

    def __init__(self, runner: SimRunner, rows: list[tuple[str, int]], seconds: float,
                 done_at: float) -> None:
        self._runner, self._rows, self._seconds, self._done_at = runner, rows, seconds, done_at
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        if self._result is None:
            self._runner.device.wait(self._done_at)
            self._result = self._runner.draw(self._rows)
            self._runner.busy_seconds += self._seconds  # timed when read, as CUDA events are
        return self._result


class SimRunner:
    def __init__(self, config, model_dir: Path) -> None:
        if config.parallel.tensor_parallel_size > 1 or config.cache.kv_offload_gib:
            raise ValueError("--device sim serves one engine's device: tensor parallelism "
                             "and the KV offload tiers are not simulated")
        if config.lora.enabled:
            raise ValueError("--device sim does not simulate LoRA adapters")
        self.config = config
        self.profile = load_profile(config.compute.sim_profile)
        self.model_config = ModelConfig.from_dir(model_dir)  # the tokenizer's: ids, EOS
        self.block_size = config.cache.block_size
        model = self.profile.model
        self.num_blocks = config.cache.num_kv_blocks or int(
            self.profile.kv_pool_bytes // (self.block_size * model.kv_bytes_per_token))
        self.max_model_len = config.checkpoint.max_model_len or model.max_model_len
        self.device = SimDevice()
        # A disaggregated engine's KV transport moves blocks of this stand-in cache (16 bytes
        # a token for each of K and V, not the model's): handshakes, leases, pulls and their
        # failures are real; their time is loopback's for those bytes, not the profile's.
        self.kv_cache = None if not config.kv_transfer.transport else _stand_in_cache(
            self.num_blocks, self.block_size)
        self.tp, self.tp_leader, self.lora = TPGroup(), None, None
        self.sampler = Sampler(config.compute.seed)  # the engine releases requests' state
        self.rejection = RejectionSampler(config.compute.seed)
        self._rng = random.Random(config.compute.seed)
        self._staging = HostStaging(_HOST)
        self._token_index: dict[str, int] = {}  # the last step's sampled rows, by request
        self.busy_seconds = 0.0  # modelled seconds of the steps read (the engine's timing)
        eos = set(self.model_config.eos_token_ids)
        self._vocab = self.model_config.vocab_size
        self._eos = eos

    # `launch` returns at once and the step's tokens are read when it ends, as on a GPU;
    # nothing reads a step's input ids, so a pending token needs no host value
    launches_async = async_by_default = True

    def launch(self, out: SchedulerOutput, block_ids_of, since: float | None = None
               ) -> SimStep:
        """Build the step's batch on the host as the model runner does (`build_batch`: the
        token ids, positions, slots, block table and the pending tokens' rows, packed into
        one buffer; on CUDA that buffer is pinned and copied), then queue the step its
        layout models on the simulated device (`since`: `SimDevice.launch`); its tokens are
        drawn when read."""
        batch = build_batch(out.rows, block_ids_of, self.block_size, _HOST, self._staging,
                            pending=self._token_index)
        rows_sampled = [(s.request.request_id, len(s.spec_token_ids))
                        for s in batch.sampling_entries]  # read now: they move on
        self._token_index = {rid: i for i, (rid, _) in enumerate(rows_sampled)}
        seconds = layout_seconds(self.profile, batch.layout.context_lens,
                                 batch.layout.seq_lens, len(batch.logits_indices))
        return SimStep(self, rows_sampled, seconds, self.device.launch(seconds, since))

    def execute(self, out: SchedulerOutput, block_ids_of) -> StepResult:
        return self.launch(out, block_ids_of).result()

    def draw(self, rows: list[tuple[str, int]]) -> StepResult:
        """A step's results for its sampling rows (request id, guesses): a token each, every
        guess rejected."""
        sampled: dict[str, list[int]] = {}
        guessed: dict[str, tuple[int, int]] = {}
        for rid, guesses in rows:
            sampled[rid] = [self._token()]
            if guesses:
                guessed[rid] = (guesses, 0)
        return StepResult(sampled, {}, {}, {}, guessed)

    def _token(self) -> int:
        while True:
            token = self._rng.randrange(self._vocab)
            if token not in self._eos:
                return token


    @property
    def idle_seconds(self) -> float:
        """Seconds the device waited on the host between steps launched with `since`."""
        return self.device.idle_s

    def close(self) -> None:
        """Nothing to stop."""


def _stand_in_cache(num_blocks: int, block_size: int):
    """(layers, K/V, blocks, block_size, KV heads, head dim) = (1, 2, N, B, 1, 8) bf16."""
    return torch.zeros(1, 2, num_blocks, block_size, 1, 8, dtype=torch.bfloat16)
