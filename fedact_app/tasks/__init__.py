"""Language tasks: what is trained for Llama pre-training (:mod:`.llama`), LoRA instruction tuning
(:mod:`.sft`) and LoRA preference optimisation (:mod:`.dpo`), with their shared tokenizers
(:mod:`.tokenizers`), text data (:mod:`.text_data`) and LoRA wrapping (:mod:`.lora`).

Plain PyTorch / transformers / peft; nothing here knows Flower or the federated algorithms
(see docs/LANGUAGE.md).
"""
