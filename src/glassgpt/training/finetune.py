"""Finetuning: a classifier head (the book's chapter 6), instruction following (chapter 7), LoRA
(appendix E), each in its own module; this one names them all in one place, as
`glassgpt.training.finetune`. The book's own chapters, run as its code runs them, are
book_ch06.py and book_ch07.py.

    examples.py   what both tasks share: data files, the validation hold-out, padding,
                  batches in shuffled epochs, which weights train (`freeze`), the lr
    classify.py   to_classifier, ClassificationTask, predict, confusion_matrix
    instruct.py   format_prompt, InstructionTask, respond
    lora.py       apply_lora, merge_lora, merged_model

Both tasks' `checkpoint_model` returns `lora.merged_model(model)`, so `latest/` and `best/`
load with `load_model` like any checkpoint, while fit keeps the frozen base and the adapters
beside them for `--resume`, which rebuilds the LoRA model and continues on exactly its base.
"""

from ..engine.loss import IGNORE_INDEX  # noqa: F401
from ..errors import DataError  # noqa: F401
from .classify import (ClassificationData, ClassificationTask, MISSING_LABELS, confusion_matrix,  # noqa: F401
                       encode_texts, last_token_logits, load_classification_data, predict, prepare_classifier,
                       split_validation, to_classifier)
from .examples import (BOOK_LR, DATA_FORMATS, ExampleStream, Records, default_lr, finetune_defaults, freeze,  # noqa: F401
                       holdout, pad_batch, pad_id_of, read_records, sample_indices, set_trainable, steps_per_epoch)
from .instruct import (ALPACA_PREAMBLE, InstructionTask, check_instruction_record, collate_instructions,  # noqa: F401
                       encode_instruction, encode_instructions, format_prompt, load_instruction_records,
                       prepare_instructions, respond, skipped_line)
from .lora import (LORA_TARGETS, LoRALinear, apply_lora, count_parameters, has_lora,  # noqa: F401
                   lora_state_dict, merge_lora, merged_model)
