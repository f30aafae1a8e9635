"""What glassgpt's own recipes train on: each a `Task` (loop/task.py) the loop is handed.

    data.py         text files -> cached token ids -> windows (pretraining)
    examples.py     what the finetuning tasks share: data files, the hold-out, padding, which weights train
    classify.py     a classifier head on the last real token (the book's chapter 6)
    instruct.py     Alpaca records, the loss on the response only (the book's chapter 7)
    lora.py         LoRA adapters (appendix E)
"""
