"""What a run trains: the ``Task`` interface (:mod:`.base`), image classification (:mod:`.vision`),
the language tasks (:mod:`.language`: ``lm_pretrain``, ``sft``, ``dpo``) and their building blocks - Llama pre-training (:mod:`.llama`), LoRA instruction
tuning (:mod:`.sft`) and LoRA preference optimisation (:mod:`.dpo`), with their shared tokenizers
(:mod:`.tokenizers`), text data (:mod:`.text_data`) and LoRA wrapping (:mod:`.lora`).

Plain PyTorch / transformers / peft; nothing here knows Flower or the federated algorithms
(language tasks: docs/LANGUAGE.md).
"""
