"""What a run trains: the ``Task`` interface (:mod:`.base`), image classification (:mod:`.vision`),
and the language tasks' building blocks - Llama pre-training (:mod:`.llama`), LoRA instruction
tuning (:mod:`.sft`) and LoRA preference optimisation (:mod:`.dpo`), with their shared tokenizers
(:mod:`.tokenizers`), text data (:mod:`.text_data`) and LoRA wrapping (:mod:`.lora`).

Plain PyTorch / transformers / peft; nothing here knows Flower or the federated algorithms
(language tasks: docs/LANGUAGE.md).
"""
