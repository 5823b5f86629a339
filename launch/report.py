"""Turn a run directory into pictures and a table: everything comes from the logged files.

    python launch/report.py runs/default

Writes <run>/solve_rate.png (held-out solve rate per eval step, training reward per step) and
<run>/final_episode.gif (the final policy's greedy play of one evaluation maze, replayed through
the env from the replies logged in eval/step_<N>.json), and prints the before/after table.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import env  # noqa: E402


def load_evals(run: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in (run / "eval").glob("step_*.json")), key=lambda r: r["step"])


def plot_curves(run: Path, evals: list[dict]) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics_file = run / "metrics.jsonl"
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in evals], [100 * r["solve_rate"] for r in evals], "o-",
            label=f"held-out solve rate ({evals[0]['total']} {evals[0]['difficulty']} mazes, greedy)")
    if metrics:
        ax.plot([m["step"] for m in metrics], [100 * m["solve_rate"] for m in metrics], alpha=0.5,
                label="training solve rate (sampled, T=1)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("% solved")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(run.name)
    fig.tight_layout()
    path = run / "solve_rate.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def replay_gif(run: Path, result: dict, cell_px: int, max_turns: int) -> Path:
    """Replay the logged replies of one eval maze (the first solved one, else the first)."""
    row = next((r for r in result["mazes"] if r["solved"]), result["mazes"][0])
    maze = env.eval_mazes(result["difficulty"], row["maze_index"] + 1)[row["maze_index"]]
    game = env.MazeEnv(maze, max_turns=max_turns, cell_px=cell_px)
    frames = [game.reset().image]
    for reply in row["replies"]:
        if game.done:
            break
        frames.append(game.step(reply).image)
    path = run / "final_episode.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=400, loop=0)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    args = parser.parse_args()
    evals = load_evals(args.run)
    if not evals:
        raise SystemExit(f"{args.run} has no eval/step_*.json yet")
    config = json.loads((args.run / "config.json").read_text())
    print(f"curve: {plot_curves(args.run, evals)}")
    print(f"episode: {replay_gif(args.run, evals[-1], config['cell_px'], config['max_turns'])}")
    best = max(evals, key=lambda r: r["solve_rate"])
    print(f"\n| | step | solved |\n|---|---|---|")
    print(f"| before GRPO | {evals[0]['step']} | {evals[0]['solved']}/{evals[0]['total']} |")
    print(f"| best | {best['step']} | {best['solved']}/{best['total']} |")
    print(f"| final | {evals[-1]['step']} | {evals[-1]['solved']}/{evals[-1]['total']} |")


if __name__ == "__main__":
    main()
