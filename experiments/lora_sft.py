"""LoRA-SFT with adapter shapes sft.py does not offer: rsLoRA scaling, other target modules.

    python experiments/lora_sft.py --rslora --model runs/main/sft/model --out runs/ceiling/rs8 --lora-rank 8 --steps 3000
    python experiments/lora_sft.py --targets wide --model runs/main/sft/model --out runs/ceiling/wide8 --lora-rank 8

Every other flag is sft.py's own, and so is the whole run: this only changes the LoraConfig that
sft.py's `--lora-rank` builds (sft.py is left as it is, since its hash keys the tests' cached
warm start). The adapter is merged into the written model, as sft.py does, so the result is
evaluated like any model (experiments/eval_policy.py).

  --rslora          lora_alpha / sqrt(r) in place of lora_alpha / r (Kalajdzievski 2023,
                    arXiv:2312.03732; PEFT's use_rslora): the update's scale no longer shrinks
                    as the rank grows
  --targets wide    the language model's projections (the main job's) plus lm_head and the
                    vision tower's mergers (the connector from image features to the language
                    model); the vision blocks themselves stay frozen
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import vllm_engine  # noqa: E402

TARGETS = {
    "main": vllm_engine.LORA_TARGET_REGEX,
    "wide": vllm_engine.LORA_TARGET_REGEX + r"|lm_head|.*visual\.(merger|deepstack_merger_list\.\d+)\.linear_fc[12]",
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     add_help=False)
    parser.add_argument("--rslora", action="store_true", help="rsLoRA scaling: alpha / sqrt(r)")
    parser.add_argument("--targets", default="main", choices=list(TARGETS), help="which modules carry the adapter")
    args, rest = parser.parse_known_args()
    if "-h" in rest or "--help" in rest:
        parser.print_help()
        print("\nThe rest are sft.py's flags:")
    import peft

    import sft

    plain = peft.LoraConfig

    def shaped(**kwargs):  # what sft.py builds, with this script's scaling and modules
        return plain(**{**kwargs, "use_rslora": args.rslora, "target_modules": TARGETS[args.targets]})

    peft.LoraConfig = shaped
    sys.argv = [sys.argv[0], *rest]
    if "--lora-rank" not in " ".join(rest):
        raise SystemExit("give --lora-rank N: this script shapes sft.py's LoRA, it does not train without one")
    sft.main()
    out = Path(rest[rest.index("--out") + 1] if "--out" in rest else "runs/sft")
    shape = {"rslora": args.rslora, "targets": args.targets, "target_modules": TARGETS[args.targets]}
    import json

    import storage

    storage.atomic_write_text(out / "model" / "LORA_SHAPE.json", json.dumps(shape, indent=2))


if __name__ == "__main__":
    sys.exit(main())
