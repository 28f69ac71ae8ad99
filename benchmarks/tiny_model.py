"""A small random Llama and a tokenizer trained on the spot: nothing is downloaded.

Two sizes: ``tiny`` (2 layers, 512 B of KV per token, milliseconds per prefill: the end-to-end
tests) and ``small`` (8 layers, 8 KiB of KV per token, ~24M parameters: prefills long enough
for the decision benchmark to measure above the noise of a shared machine).
"""

from __future__ import annotations

from pathlib import Path

SIZES = {
    "tiny": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "small": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
}


def build_tiny_llama(folder: Path, seed: int, size: str = "tiny") -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator([f"word{i} token{i % 37} text{i % 11}" for i in range(3000)], trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=512,
        **SIZES[size],
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder
