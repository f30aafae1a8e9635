"""training: the loop, its config, checkpoints and run directories, the pretraining and finetuning tasks, LoRA.

    loop.py        `fit(model, task, cfg)`: the training loop, and TrainConfig
    checkpoint.py  latest/ and best/, written whole and resumed exactly
    rundir.py      one process at a time in a run directory
    data.py        text files -> cached token ids -> windows (the pretraining task)
    finetune.py    classification (the book's chapter 6) and instruction following (chapter 7)
    lora.py        LoRA adapters (appendix E)
"""
