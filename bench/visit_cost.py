"""What one visit of a training maze costs GRPO, against what it costs SFT, on this machine.

    python bench/visit_cost.py --model runs/main/sft/model                 # this checkout
    python bench/visit_cost.py --model runs/main/sft/model --before ../old  # and another one, same run
    python bench/visit_cost.py --model runs/main/sft/model --branch-points 2  # and GRPO with branch rollouts

A visit is what each learner does with one maze: SFT trains on one demonstration of it; GRPO
plays it group_size times with the engine and trains on the episodes that carry a signal. Both
start from the same warm start and see the same kind of mazes (7x7, 15 turns, full image history).
Measured as the median seconds per optimizer step over the steps after warm-up, divided by the
mazes a step visits (SFT: --batch-size; GRPO: --prompts-per-step). Each learner runs as its own
process, one after the other, so they do not share the cores. Writes bench/results/<date>-visit_cost.json.

With --branch-points K, GRPO runs a second time with branch rollouts (branch.py, K points per
group), and both GRPO runs report what the engine did per step: turns it generated (one reply
each; a branch's forced reply is not one) and tokens it generated, the branches' share apart.
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sft_seconds_per_step(code: Path, model: str, steps: int, batch: int, out: Path) -> float:
    """Median seconds per SFT step, from the wall-clock stamps sft.py logs every 5 steps."""
    subprocess.run([sys.executable, "sft.py", "--model", model, "--out", str(out), "--steps", str(steps),
                    "--batch-size", str(batch), "--log-every", "5", "--warmup", "1"], cwd=code, check=True,
                   capture_output=True, text=True)
    stamps = [json.loads(line) for line in (out / "sft_metrics.jsonl").read_text().splitlines()
              if "wall_s" in line]
    gaps = [(b["wall_s"] - a["wall_s"]) / (b["step"] - a["step"]) for a, b in zip(stamps, stamps[1:])]
    return statistics.median(gaps[1:] or gaps)  # the first interval holds the start-up


def grpo_seconds_per_step(code: Path, model: str, steps: int, args: list, out: Path) -> tuple[float, dict]:
    """Median step_s over steps 3..N (the first ones hold the engine's warm-up), and phase medians."""
    subprocess.run([sys.executable, "train.py", "--model", model, "--out-dir", str(out), "--steps", str(steps),
                    "--eval-interval", "1000", "--eval-puzzles", "8", "--ckpt-interval", "1000",
                    "--export-interval", "1000", "--progress", "false", *args], cwd=code, check=True,
                   capture_output=True, text=True)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][2:-1]
    phases = {k: statistics.median(m[k] for m in lines) for k in ("rollout_s", "update_s", "sync_s", "step_s")}
    phases["trained_sequence_frac"] = statistics.mean(m["trained_sequence_frac"] for m in lines)
    episodes = int(args[args.index("--prompts-per-step") + 1]) * int(args[args.index("--group-size") + 1])
    engine = {"engine_turns": statistics.mean(m["episode_turns"] * episodes for m in lines),
              "generated_tokens": statistics.mean(m["generated_tokens"] for m in lines)}
    for k in ("branch_points", "branch_targets", "branch_episodes", "branch_engine_turns", "branch_generated_tokens",
              "branch_s"):
        if k in lines[0]:
            engine[k] = statistics.mean(m[k] for m in lines)
    phases["per_step"] = engine
    return phases["step_s"], phases


def measure(code: Path, args) -> dict:
    # plain GRPO first (branches off: on by default for the tiny model since 2026-12-03), then with K
    grpo = ["--lora-rank", "8", "--branch-points-per-group", "0",
            "--prompts-per-step", str(args.prompts), "--group-size", str(args.group),
            "--max-new-tokens", "8", "--step-adv-weight", "1", "--micro-batch-size", "16", "--lr", "1e-3",
            "--temperature", str(args.temperature)]
    with tempfile.TemporaryDirectory() as tmp:
        sft_s = sft_seconds_per_step(code, args.model, args.sft_steps, args.batch, Path(tmp) / "sft")
        grpo_s, phases = grpo_seconds_per_step(code, args.model, args.grpo_steps, grpo, Path(tmp) / "grpo")
        if args.branch_points:
            branch_s, branch_phases = grpo_seconds_per_step(
                code, args.model, args.grpo_steps, grpo + ["--branch-points-per-group", str(args.branch_points)],
                Path(tmp) / "branch")
    sft_visit, grpo_visit = sft_s / args.batch, grpo_s / args.prompts
    result = {"code": str(code), "sft_step_s": sft_s, "sft_visit_s": sft_visit, "grpo_step_s": grpo_s,
              "grpo_visit_s": grpo_visit, "grpo_phases": phases, "ratio": grpo_visit / sft_visit}
    if args.branch_points:
        result.update(branch_step_s=branch_s, branch_visit_s=branch_s / args.prompts, branch_phases=branch_phases,
                      branch_ratio=branch_s / args.prompts / sft_visit)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the warm start both learners start from")
    parser.add_argument("--before", default="", help="another checkout of this project to measure in the same run")
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=4, help="SFT mazes per step")
    parser.add_argument("--grpo-steps", type=int, default=14)
    parser.add_argument("--prompts", type=int, default=4, help="GRPO mazes per step")
    parser.add_argument("--group", type=int, default=8, help="GRPO episodes per maze")
    parser.add_argument("--temperature", type=float, default=0.5, help="GRPO's sampling temperature (the main job's)")
    parser.add_argument("--branch-points", type=int, default=0, help=">0: GRPO again with this many branch points per group")
    args = parser.parse_args()
    args.model = str(Path(args.model).resolve())
    runs = {}
    if args.before:
        runs["before"] = measure(Path(args.before).resolve(), args)
    runs["now"] = measure(ROOT, args)
    result = {"date": datetime.datetime.now().strftime("%Y-%m-%d-%H%M"), "command": " ".join(sys.argv),
              "threads": os.environ.get("OMP_NUM_THREADS", "all"), "load": [round(x, 2) for x in os.getloadavg()],
              "settings": vars(args), "runs": runs}
    print("| code | SFT s/step | SFT s/visit | GRPO s/step (rollout, update) | GRPO s/visit | GRPO / SFT per visit |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in runs.items():
        p = r["grpo_phases"]
        print(f"| {name} | {r['sft_step_s']:.3f} | {r['sft_visit_s']:.3f} | {r['grpo_step_s']:.2f} "
              f"({p['rollout_s']:.2f}, {p['update_s']:.2f}) | {r['grpo_visit_s']:.3f} | {r['ratio']:.1f}x |")
    for name, r in runs.items():
        if "branch_phases" not in r:
            continue
        plain, with_branches = r["grpo_phases"]["per_step"], r["branch_phases"]["per_step"]
        p = r["branch_phases"]
        print(f"\n{name}, with --branch-points-per-group {args.branch_points}: {r['branch_step_s']:.2f} s/step "
              f"(rollout {p['rollout_s']:.2f}, of it branches {with_branches['branch_s']:.2f}; update {p['update_s']:.2f}), "
              f"{r['branch_visit_s']:.3f} s/visit, {r['branch_ratio']:.1f}x SFT's")
        print("| per step | engine turns | generated tokens | branch points | targets |")
        print("| --- | --- | --- | --- | --- |")
        print(f"| GRPO | {plain['engine_turns']:.0f} | {plain['generated_tokens']:.0f} | - | - |")
        print(f"| GRPO + branches: groups | {with_branches['engine_turns']:.0f} | {with_branches['generated_tokens']:.0f} "
              f"| {with_branches['branch_points']:.1f} | {with_branches['branch_targets']:.1f} |")
        print(f"| GRPO + branches: extra | {with_branches['branch_engine_turns']:.0f} "
              f"| {with_branches['branch_generated_tokens']:.0f} | | |")
    out = ROOT / "bench" / "results" / f"{result['date']}-visit_cost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
