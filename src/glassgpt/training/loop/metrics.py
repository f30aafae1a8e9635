"""RUN_DIR/metrics.jsonl, read and written, and the picture of a run (loss.png).

One JSON object per logged step:
    step, tokens, train_loss, lr, tokens_per_s, elapsed_s, grad_norm (when clipping)
and on evaluation steps also
    val_loss, val_ppl, the task's metrics (val_accuracy; the book's recipe: train_eval_loss,
    epoch), sample, and `snapshot` (snapshot.py: the top-5 next tokens of the
    sample prompt, the greedy continuation, the logit lens per block).

`read_metrics` is what every reader uses (plot, resume, the web page's slider); lines
that are not a record (a half-written last line, bytes a disk or an editor damaged) are
skipped. `plot_run` draws the loss against tokens seen and, when the run has snapshots,
the probability of every token that was ever in the sample prompt's top 5;
`save_confusion` and `save_confusion_png` a classifier's confusion matrix (confusion.json, .png);
every file written whole and never through a symbolic link (formats/files.py).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import TrainError
from ...formats.files import atomic_write, open_to_write

FILE = "metrics.jsonl"


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of RUN_DIR/metrics.jsonl, in order (damaged lines skipped)."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        raise TrainError(f"{run_dir} has no {FILE}: is it a training run directory?")
    records = []
    for line in path.read_bytes().splitlines():
        with contextlib.suppress(ValueError):  # UnicodeDecodeError is a ValueError too
            record = json.loads(line.decode("utf-8"))
            if isinstance(record, dict) and all(type(record.get(k)) is int for k in ("step", "tokens")):
                records.append(record)
    return records


def append_metrics(run_dir: Path, record: dict[str, Any]) -> None:
    with open_to_write(run_dir / FILE, "a", TrainError) as f:  # never through a link
        f.write(json.dumps(record, ensure_ascii=False) + "\n")


def truncate_metrics(run_dir: Path, step: int) -> None:
    """On resume, drop the lines logged after the checkpoint's step (they will be logged again)."""
    if not (run_dir / FILE).is_file():
        return
    kept = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in read_metrics(run_dir) if r["step"] <= step)
    atomic_write(run_dir / FILE, lambda tmp: Path(tmp).write_text(kept, encoding="utf-8"), TrainError)


def snapshot_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluation records that carry a snapshot (none in runs made before snapshots)."""
    return [r for r in records if isinstance(r.get("snapshot"), dict) and r["snapshot"].get("top")]


# --- the picture -------------------------------------------------------------------------------

def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path | None:
    """Draw RUN_DIR/loss.png (or `out`): the loss against tokens seen, and below it, when the run
    has snapshots, each token's probability as the next token of the sample prompt.

    Returns the path, or None when matplotlib is not installed.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    snaps = snapshot_records(records)
    fig = Figure(figsize=(7.5, 7.5 if snaps else 4.5), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True) if snaps else [fig.add_subplot()]
    _draw_loss(axes[0], records)
    axes[0].set_title(run_dir.resolve().name + ("" if snaps else "  (no snapshots in this run: the loss alone)"))
    if snaps:
        _draw_tokens(axes[1], snaps)
    axes[-1].set_xlabel("tokens seen")
    out = Path(out) if out is not None else run_dir / "loss.png"
    atomic_write(out, lambda tmp: fig.savefig(tmp, format="png", dpi=120), TrainError)
    return out


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["tokens"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return tuple(map(list, zip(*points))) if points else ([], [])  # type: ignore[return-value]


def _draw_loss(ax, records: list[dict[str, Any]]) -> None:
    x, y = _series(records, "train_loss")
    if y:
        ax.plot(x, y, color="tab:blue", alpha=0.3, linewidth=0.8, label="train (each logged step)")
        w = len(y) // 25
        if w > 1:  # a centred running mean shows the trend through the noise, without lag
            mean = np.convolve(y, np.ones(w) / w, mode="valid")
            ax.plot(x[(w - 1) // 2:][:len(mean)], mean, color="tab:blue", linewidth=1.6,
                    label=f"train (mean of {w} steps)")
    for key, style, label in (("train_eval_loss", "s--", "train (evaluated, as the book does)"),
                              ("val_loss", "o-", "validation")):
        x, y = _series(records, key)
        if y:
            ax.plot(x, y, style, color="tab:orange" if key == "val_loss" else "tab:green", linewidth=1.6,
                    markersize=4, label=label)
    ax.set_ylabel("cross-entropy loss (nats per token)")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()


def _draw_tokens(ax, snaps: list[dict[str, Any]], labelled: int = 8) -> None:
    """One line per token ever in the top 5; a token is drawn only where it was in the top 5
    (below the dashed line, the 5th probability, nothing was recorded)."""
    x = [r["tokens"] for r in snaps]
    seen: dict[int, dict[str, Any]] = {}
    for k, r in enumerate(snaps):
        for entry in r["snapshot"]["top"]:
            line = seen.setdefault(entry["id"], {"text": entry["text"], "prob": [np.nan] * len(snaps)})
            line["prob"][k] = entry["prob"]
    ranked = sorted(seen.values(), key=lambda line: -np.nanmax(line["prob"]))
    final_top = snaps[-1]["snapshot"]["top"][0]["id"]
    for i, line in enumerate(ranked):
        is_final = line is seen[final_top]
        ax.plot(x, line["prob"], "o-", markersize=3, linewidth=2.4 if is_final else 1.2,
                alpha=1.0 if i < labelled or is_final else 0.35, zorder=3 if is_final else 2,
                label=repr(line["text"]) if i < labelled or is_final else None)
    fifth = [r["snapshot"]["top"][-1]["prob"] for r in snaps]
    ax.plot(x, fifth, "--", color="grey", linewidth=0.8, label="5th probability (below: not recorded)")
    prompt = snaps[-1]["snapshot"]["prompt"]
    ax.set_title(f"next token after {prompt[-60:]!r}: every token ever in the top 5", fontsize=10)
    ax.set_ylabel("probability (log scale: from 1 / vocab_size up)")
    ax.set_yscale("log")
    ax.set_ylim(min(fifth) / 2, 1.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)


def save_confusion(record: dict[str, Any], path: Path) -> Path:
    """A classifier's confusion matrix as JSON (RUN_DIR/confusion.json), never through a link."""
    text = json.dumps(record, indent=1)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"), TrainError)
    return path


def save_confusion_png(matrix: list[list[int]], labels: list[str], path: Path) -> Path | None:
    """A classifier's confusion matrix as a picture (rows actual, columns predicted), never through a
    link; None without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    n = len(labels)
    fig = Figure(figsize=(1.2 + 0.7 * n, 1.0 + 0.6 * n), layout="constrained")
    ax = fig.add_subplot()
    ax.imshow(matrix, cmap="Blues")
    top = max(max(row) for row in matrix) or 1
    for a in range(n):
        for p in range(n):
            ax.text(p, a, f"{matrix[a][p]:,}", ha="center", va="center",
                    color="white" if matrix[a][p] > top / 2 else "black")
    ax.set_xticks(range(n), labels, rotation=45 if n > 4 else 0)
    ax.set_yticks(range(n), labels)
    ax.set_xlabel("predicted")
    ax.set_ylabel("actual")
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120), TrainError)
    return path
