"""The loop and its machinery: what every training run shares, whatever it trains on.

    loop.py         `fit(model, task, cfg)` and `train(run)`: the loop, in the book's order
    task.py         Task, the base class of what the loop trains on
    config.py       TrainConfig (every setting declared once), the two recipes' settings, the lr schedule
    run.py          Run: the machinery around the loop, behind the names it calls
    compute.py      the model as the step runs it: placed, sharded, bf16, fused, compiled, DDP; AdamW
    distributed.py  one process, or one rank of a torchrun job
    checkpoint.py   latest/ and best/, written whole, when to write them, resumed exactly
    rundir.py       one process at a time in a run directory; new run or resume, checked once
    faults.py       signals, divergence, disks that refuse a write
    metrics.py      metrics.jsonl (`read_metrics`), loss.png and a classifier's confusion.png
    snapshot.py     what the model predicts for the sample prompt at each evaluation (the logit lens)
"""
