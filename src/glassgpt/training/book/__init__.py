"""The book's chapters, run as its code runs them (`--recipe book`), each to hold beside its listing.

    ch05.py         chapter 5: its loaders, evaluation and samples (`train --recipe book`)
    appendix_d.py   appendix D: train_model (warm-up, cosine decay, clipping) on chapter 5's data
    ch06.py         chapter 6 (`finetune classify --recipe book`)
    ch07.py         chapter 7 (`finetune instruct --recipe book`)
"""
