"""What a training run shows while it runs: `Printer`, the `log` that `glassgpt train` and
`glassgpt finetune` hand to `fit`.

On a terminal, a tqdm bar (step, loss, lr, tokens/s, ETA) on stderr. Written to a file or a
pipe, tqdm would leave a line per refresh, so there a plain line goes to stderr every tenth of
the run (or every EVERY_S seconds, if sooner) and at the end. `Heartbeat` is the same plain line
for any other long work (generate's tokens, finetune's responses, explain's passes): the work
done, its rate and an estimate of what is left, at least every EVERY_S seconds of work. Evaluations and samples print to stdout,
above the bar: glassgpt's `step N: val_loss ...` lines, or, for `--recipe book`, the book's own
`Ep 1 (Step 000000): Train loss 9.781, Val loss 9.933` and its samples.
"""

from __future__ import annotations

import sys
import time
from typing import Any


EVERY_S = 10.0  # the longest a long piece of work goes without a line where no bar shows

NOT_METRICS = {"event", "step", "tokens", "train_loss", "lr", "tokens_per_s", "elapsed_s", "grad_norm", "sample",
               "snapshot", "max_steps", "epoch"}


class Printer:
    def __init__(self, progress: bool = True, line: str | None = None):
        self.progress, self.line = progress, line  # line: a recipe's own evaluation line (the book's), else glassgpt's
        self.bar = None
        self.last_step, self.last_time, self.every, self.total = 0, time.monotonic(), 1, 0

    def __call__(self, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "start":
            self._open(event["step"], event["max_steps"])
        elif kind == "line":
            self.write(event["text"])
        elif kind == "note":
            self.write(f"note: {event['text']}", sys.stderr)
        elif kind == "step":
            self._step(event)
        elif kind == "end":
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def _open(self, start: int, total: int) -> None:
        self.total, self.last_step, self.last_time = total, start, time.monotonic()
        self.every = max(1, (total - start) // 10)
        if self.progress and sys.stderr.isatty():
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, desc="train")

    def _step(self, record: dict[str, Any]) -> None:
        if "val_loss" in record or "val_accuracy" in record or "train_eval_loss" in record:
            self.write(self.evaluation_line(record))
        if record.get("sample") is not None:
            text = record["sample"]
            self.write(text.replace("\n", " ") if self.line else
                       "  sample: " + text.replace("\n", "\n          "))
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['train_loss']:.4f}", lr=f"{record['lr']:.2e}",
                                 tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
            self.bar.update(record["step"] - self.bar.n)
        elif self.progress:
            self._plain_line(record)

    def evaluation_line(self, record: dict[str, Any]) -> str:
        if self.line:  # (the book's loops count global_step from 0)
            return self.line.format(global_step=record["step"] - 1, **record)
        metrics = "  ".join(f"{k} {v:.4f}" if v is not None else f"{k} -"
                            for k, v in record.items() if k not in NOT_METRICS)
        return f"step {record['step']:,}: {metrics}"

    def _plain_line(self, r: dict[str, Any]) -> None:
        step, now = r["step"], time.monotonic()
        if not (step - self.last_step >= self.every or now - self.last_time >= EVERY_S or step == self.total):
            return
        rate = (step - self.last_step) / max(now - self.last_time, 1e-9)
        line = (f"train: step {step:,}/{self.total:,}  {rate:.1f} step/s  loss {r['train_loss']:.4f}  "
                f"lr {r['lr']:.2e}  {r['tokens_per_s']:,.0f} tok/s")
        if step < self.total:
            line += f"  eta {duration((self.total - step) / max(rate, 1e-9))}"
        print(line, file=sys.stderr, flush=True)
        self.last_step, self.last_time = step, now

    def write(self, text: str, file=None) -> None:
        if self.bar is not None:
            self.bar.write(text, file=file)
        else:
            print(text, file=file or sys.stdout, flush=True)


def duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Heartbeat:
    """A plain progress line on stderr at least every `every` seconds of work (checked at each call):
    `desc: 1,200/100,000 tokens, 35.2 tokens/s, eta 46m48s`; for output that is not a terminal."""

    def __init__(self, desc: str, unit: str, total: int | None = None, every: float = EVERY_S, file=None):
        self.desc, self.unit, self.total, self.every, self.file = desc, unit, total, every, file
        self.start = self.last = time.monotonic()

    def __call__(self, done: int, total: int | None = None) -> None:
        now = time.monotonic()
        if now - self.last < self.every:
            return
        self.last = now
        total = total if total is not None else self.total
        rate = done / max(now - self.start, 1e-9)
        line = f"{self.desc}: {done:,}" + (f"/{total:,}" if total else "") + f" {self.unit}s, {rate:,.1f} {self.unit}s/s"
        if total and done < total:
            line += f", eta {duration((total - done) / max(rate, 1e-9))}"
        print(line, file=self.file or sys.stderr, flush=True)


class StepBar:
    """The progress of one long pass, as `progress(step, done, total)` callbacks: a tqdm bar on stderr
    when it is a terminal, shown once the pass has taken half a second; else a `Heartbeat` line at least
    every EVERY_S seconds."""

    def __init__(self, desc: str, unit: str = "block"):
        self.desc, self.unit, self.bar = desc, unit, None
        self.heartbeat = None if sys.stderr.isatty() else Heartbeat(desc, unit)

    def __enter__(self) -> "StepBar":
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()

    def __call__(self, step: str, done: int, total: int) -> None:
        if self.heartbeat is not None:
            self.heartbeat(done, total)
            return
        if self.bar is None:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, desc=self.desc, unit=self.unit, delay=0.5, dynamic_ncols=True, leave=False)
        self.bar.update(done - self.bar.n)
