"""The house target's tokenizer: a byte-level BPE trained with `tokenizers`, plus its chat template.

The chat template marks assistant content with `{% generation %}` so `apply_chat_template(...,
return_assistant_tokens_mask=True)` yields exact assistant-token masks. Turn layout:

    <|system|>\\n{content}<|end|>\\n<|user|>\\n{content}<|end|>\\n<|assistant|>\\n{content}<|end|>\\n

The assistant's `<|end|>` (end of turn) is part of the assistant span; the `<|assistant|>\\n` header is not.
Raw (non-chat) documents are separated by `<|endoftext|>`. This module does not train the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"
END_OF_TURN = "<|end|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
SPECIAL_TOKENS = (END_OF_TEXT, END_OF_TURN, *ROLE_TOKENS)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|assistant|>\n' }}{% generation %}{{ message['content'] }}{{ '<|end|>' }}{% endgeneration %}{{ '\n' }}"
    "{%- else -%}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\n' }}{%- endif -%}"
)


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Plain-Python rendering identical to CHAT_TEMPLATE (used to build the training stream fast)."""
    parts = []
    for m in messages:
        parts.append(f"<|{m['role']}|>\n{m['content']}{END_OF_TURN}\n")
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE and wrap it as a `PreTrainedTokenizerFast` with the chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )

    def batches() -> Iterator[list[str]]:
        batch: list[str] = []
        for t in texts:
            batch.append(t)
            if len(batch) == 256:
                yield batch
                batch = []
        if batch:
            yield batch

    tok.train_from_iterator(batches(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=END_OF_TURN, pad_token=END_OF_TEXT, unk_token=None,
        additional_special_tokens=[END_OF_TEXT, *ROLE_TOKENS], clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
