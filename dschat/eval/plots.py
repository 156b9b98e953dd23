"""The report's figures: PPO curves (reward, KL, response length; turns and cut share with --env) and step 3's
held-out evaluation."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dschat.eval.metrics_file import finite_number


#: The PPO figure's panels: (metrics key, y label); the episode panels only when step 3 ran with --env.
PPO_PANELS = (("reward", "reward-model score"), ("kl_to_ref", "KL to reference"),
              ("response_length", "response length (tokens)"))
EPISODE_PANELS = (("turns", "actor turns per episode"), ("cut_share", "share of episodes cut"))


def metrics_figure(records: Sequence[dict[str, float]], title: str = "PPO (step 3)") -> Any:
    """The figure of :func:`plot_metrics`: reward, KL to the reference and response length against
    PPO step, one panel each, and when a record carries ``turns`` (step 3's ``--env``) the actor turns
    per episode and the share of episodes cut below them (a matplotlib ``Figure`` on an Agg canvas)."""
    panels = PPO_PANELS + (EPISODE_PANELS if any("turns" in r for r in records) else ())
    # Constrained layout places the titles, tick labels and axis labels at every draw (savefig
    # included), once their sizes are known, so every label stays inside the figure.
    fig = Figure(figsize=(7, 8 * len(panels) / len(PPO_PANELS)), dpi=100, layout="constrained")
    fig.get_layout_engine().set(w_pad=0.1, h_pad=0.1)  # inches of margin around every panel
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True)
    for ax, (key, label) in zip(axes, panels):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", markersize=2, linewidth=1)
        else:
            ax.text(0.5, 0.5, f"no '{key}' in metrics", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("PPO step")
    fig.suptitle(title if records else f"{title}: no metrics.jsonl records")
    return fig


def plot_metrics(records: Sequence[dict[str, float]], png: str | Path, title: str = "PPO (step 3)") -> Path:
    """Write :func:`metrics_figure` to ``png``."""
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    metrics_figure(records, title).savefig(png)
    return png


def plot_evaluation(records: Sequence[dict[str, Any]], png: str | Path,
                    title: str = "Held-out evaluation (step 3)") -> Path:
    """Step 3's held-out evaluations (``metrics.jsonl`` records of kind ``eval``) on one figure: the
    proxy and each judge (mean, +-1 standard error), KL to the reference, answer length and token
    entropy against the PPO step; the best evaluation (green) and the first over-optimization alarm
    (red) marked on every panel."""
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    judges = sorted({name for r in records for name in (r.get("judges") or {})})
    panels: list[tuple[str, list[tuple[str, str | None, str | None]]]] = [
        ("proxy (trained on)", [("proxy", "proxy", "proxy_se")])]
    panels += [(f"judge: {name}", [(name, f"judges.{name}", f"judges_se.{name}")]) for name in judges]
    panels += [("KL to reference", [("kl", "kl_to_ref", None)]), ("answer length (tokens)", [("len", "response_length", None)]),
               ("token entropy (nats)", [("ent", "entropy", None)])]

    def value(record: dict[str, Any], key: str | None) -> float | None:
        if key is None:
            return None
        head, _, tail = key.partition(".")
        got = record.get(head)
        return finite_number(got.get(tail) if tail and isinstance(got, dict) else got)

    fig = Figure(figsize=(7, 2.0 * len(panels) + 1), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    steps = [r.get("global_step", i) for i, r in enumerate(records)]
    best = next((r.get("best_step") for r in reversed(records) if r.get("best_step") is not None), None)
    alarm = next((r["alarm"] for r in records if r.get("alarm")), None)
    for ax, (label, series) in zip(axes, panels):
        for _, key, se_key in series:
            points = [(x, value(r, key), value(r, se_key)) for x, r in zip(steps, records) if value(r, key) is not None]
            if points:
                xs, ys, ses = zip(*points)
                ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.2)
                if all(e is not None for e in ses):
                    ax.fill_between(xs, [y - e for y, e in zip(ys, ses)], [y + e for y, e in zip(ys, ses)], alpha=0.2)
            else:
                ax.text(0.5, 0.5, f"no '{key}' in the records", ha="center", va="center", transform=ax.transAxes)
        if best is not None:
            ax.axvline(best, color="tab:green", linestyle="--", linewidth=1, label=f"best (step {best})")
        if alarm is not None:
            ax.axvline(alarm["step"], color="tab:red", linewidth=1.2, label=f"alarm (step {alarm['step']})")
        ax.set_ylabel(label, fontsize=8)
        ax.grid(True, alpha=0.3)
    if best is not None or alarm is not None:
        axes[0].legend(fontsize=7, loc="best")
    axes[-1].set_xlabel("PPO step")
    fig.suptitle(title if records else f"{title}: no evaluation records")
    fig.tight_layout()
    fig.savefig(png)
    return png
