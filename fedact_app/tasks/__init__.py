"""What a run trains: the ``Task`` interface (:mod:`.base`), image classification (the :mod:`.vision` package),
the language tasks (:mod:`.language`: ``lm_pretrain``, ``sft``, ``dpo``) and their building blocks - Llama pre-training (:mod:`.llama`), LoRA instruction
tuning (:mod:`.sft`) and LoRA preference optimisation (:mod:`.dpo`), with their shared tokenizers
(:mod:`.tokenizers`), text data (:mod:`.text_data`) and LoRA wrapping (:mod:`.lora`); :mod:`.hub`: the one error for
a hub model, tokenizer or dataset that cannot be loaded.

Plain PyTorch / transformers / peft; nothing here knows Flower or the federated algorithms
(language tasks: docs/LANGUAGE.md).
"""
