"""The exact average of several LoRA adapters of one run, as one adapter vLLM and PEFT can load.

    python experiments/average_adapters.py --out runs/avg runs/main/grpo/adapters/step_100 \
        runs/main/grpo/adapters/step_150
    python experiments/eval_policy.py --model runs/main/sft/model --adapter runs/avg
    python experiments/average_adapters.py --factorwise --out runs/fw ...   # mean A, mean B: rank r
    python experiments/average_adapters.py --scale 0.6 --out runs/shrunk runs/main/grpo/adapters/step_150

The factor-wise mean (the mean of the A's, the mean of the B's) keeps the rank, which is what an
8B model's exports can afford, but it is not the mean of the deltas: mean(B) @ mean(A) holds the
cross terms B_i @ A_j. The command prints its error, ||factor-wise - exact|| / ||exact|| over
every module's delta. --scale c writes c times one adapter's delta (B scaled): does the policy
overshoot (a smaller step is better) or is it noise (a smaller step is just a weaker policy)?

Why: between two evaluations of a GRPO run a quarter of the held-out mazes flip (solved ->
failed and back) while the count moves by a few; the greedy policy sits on near-ties that
each update's noise tips one way or the other. Averaging the last few adapters (Polyak / tail
averaging) asks whether the mean policy is better than any one of them.

A LoRA delta is scale * B @ A. The mean of k deltas, (scale / k) * sum_i B_i @ A_i, is itself a
LoRA of rank k * r: A = the A_i stacked (rows), B = the B_i side by side (columns), divided by k.
So the average is exact (not the mean of the A's times the mean of the B's). vLLM takes only some
ranks (vllm_engine.VLLM_LORA_RANKS), so the rank is padded with zero rows and columns up to the next
one, and lora_alpha is set so that PEFT's scale (alpha / r, or alpha / sqrt(r) with rsLoRA) stays
the adapters' own.
"""

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import checkpoint  # noqa: E402
import storage  # noqa: E402
import vllm_engine  # noqa: E402
from experiments.eval_policy import adapter_config  # noqa: E402

WEIGHTS = "adapter_model.safetensors"
BASE_FILE = checkpoint.BASE_MODEL_FILE  # the base an export was trained on


def average(adapters: list[Path], out: Path) -> int:
    """Write the exact mean of `adapters` (same base, rank, alpha and modules) to `out`; returns its
    rank. Refuses adapters that do not match, in one line."""
    import torch
    from safetensors.torch import load_file, save_file

    configs = [adapter_config(str(a)) for a in adapters]
    shape = [(c["r"], c["lora_alpha"], c.get("use_rslora", False), str(c["target_modules"])) for c in configs]
    if len(set(shape)) != 1:
        raise SystemExit(f"adapters differ in rank, alpha, rsLoRA or modules: {shape}")
    bases = {(a / BASE_FILE).read_text() if (a / BASE_FILE).exists() else None for a in adapters}
    if len(bases) != 1:
        raise SystemExit("adapters were trained on different bases (their base_model.json differ)")
    r, alpha, rslora, _ = shape[0]
    k = len(adapters)
    rank = next((n for n in vllm_engine.VLLM_LORA_RANKS if n >= k * r), None)
    if rank is None:
        raise SystemExit(f"{k} adapters of rank {r} make rank {k * r}: more than vLLM takes")
    weights = [load_file(str(a / WEIGHTS)) for a in adapters]
    if any(w.keys() != weights[0].keys() for w in weights):
        raise SystemExit("adapters differ in their tensors")
    mean = {}
    for name in weights[0]:
        if ".lora_A." in name:  # (r, in) each -> (rank, in)
            stacked = torch.cat([w[name] for w in weights], dim=0)
            pad = stacked.new_zeros(rank - k * r, stacked.shape[1])
            mean[name] = torch.cat([stacked, pad], dim=0).contiguous()
        elif ".lora_B." in name:  # (out, r) each -> (out, rank), 1/k of each
            stacked = torch.cat([w[name] for w in weights], dim=1) / k
            pad = stacked.new_zeros(stacked.shape[0], rank - k * r)
            mean[name] = torch.cat([stacked, pad], dim=1).contiguous()
        else:
            raise SystemExit(f"{name}: only LoRA A and B tensors can be averaged this way")
    # PEFT's scale is alpha / r (alpha / sqrt(r) with rsLoRA): keep the adapters' own at the new rank
    new_alpha = alpha * (math.sqrt(rank / r) if rslora else rank / r)
    new_alpha = int(new_alpha) if float(new_alpha).is_integer() else new_alpha  # an int where it is one
    # the whole directory at once, as the trainer writes its exports (storage.publish_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    storage.remove_tmp(tmp)
    tmp.mkdir()
    save_file(mean, str(tmp / WEIGHTS))
    config = dict(configs[0], r=rank, lora_alpha=new_alpha, rank_pattern={}, alpha_pattern={})
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    if (adapters[0] / BASE_FILE).exists():
        shutil.copyfile(adapters[0] / BASE_FILE, tmp / BASE_FILE)
    storage.publish_dir(tmp, out)
    return rank


def write_like(adapter: Path, weights: dict, out: Path):
    """`weights` as an adapter with `adapter`'s config and base, written whole (temp dir, rename)."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    storage.remove_tmp(tmp)
    tmp.mkdir()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / WEIGHTS))
    shutil.copyfile(adapter / "adapter_config.json", tmp / "adapter_config.json")
    if (adapter / BASE_FILE).exists():
        shutil.copyfile(adapter / BASE_FILE, tmp / BASE_FILE)
    storage.publish_dir(tmp, out)


def deltas(weights: dict) -> dict:
    """Each module's B @ A (PEFT's scale left out: the same for all adapters of a run)."""
    return {name: weights[name.replace(".lora_A.", ".lora_B.")] @ weights[name]
            for name in weights if ".lora_A." in name}


def factorwise(adapters: list[Path], out: Path) -> float:
    """Write the factor-wise mean (mean A, mean B, rank r) to `out`; returns its relative error
    against the exact mean of the deltas, ||sum (fw - exact)||_F / ||exact||_F over all modules."""
    from safetensors.torch import load_file

    weights = [load_file(str(a / WEIGHTS)) for a in adapters]
    mean = {name: sum(w[name] for w in weights) / len(weights) for name in weights[0]}
    exact = {name: sum(d[name] for d in map(deltas, weights)) / len(weights) for name in deltas(weights[0])}
    approx = deltas(mean)
    error = sum(float((approx[n] - exact[n]).pow(2).sum()) for n in exact) ** 0.5
    write_like(adapters[0], mean, out)
    return error / max(sum(float(exact[n].pow(2).sum()) for n in exact) ** 0.5, 1e-30)


def scaled(adapter: Path, factor: float, out: Path):
    """Write `factor` times the adapter's delta (its B's scaled) to `out`."""
    from safetensors.torch import load_file

    weights = load_file(str(adapter / WEIGHTS))
    write_like(adapter, {k: v * factor if ".lora_B." in k else v for k, v in weights.items()}, out)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("adapters", type=Path, nargs="+", help="PEFT LoRA directories of one run (its exports)")
    parser.add_argument("--out", type=Path, required=True, help="where the averaged adapter goes")
    parser.add_argument("--factorwise", action="store_true", help="mean A and mean B (rank r), and its error")
    parser.add_argument("--scale", type=float, default=None, help="c x one adapter's delta instead of a mean")
    args = parser.parse_args()
    if args.scale is not None:
        if len(args.adapters) != 1:
            raise SystemExit("--scale takes one adapter")
        scaled(args.adapters[0], args.scale, args.out)
        print(f"{args.out}: {args.scale} x {args.adapters[0]}")
    elif args.factorwise:
        error = factorwise(args.adapters, args.out)
        print(f"{args.out}: the factor-wise mean of {len(args.adapters)} adapters; its delta is off the exact mean's "
              f"by {error:.1%} (relative Frobenius error over all modules)")
    else:
        rank = average(args.adapters, args.out)
        print(f"{args.out}: the mean of {len(args.adapters)} adapters, rank {rank}")


if __name__ == "__main__":
    main()
