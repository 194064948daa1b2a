"""Golden loss masks, token by token, for real chat templates (Llama-3, Qwen2.5/ChatML, Qwen3 thinking and
non-thinking, Mistral, Gemma, and the house target's).

Each template string below is the one published with the model's tokenizer_config.json. The test tokenizer is
the house BPE with each family's special tokens added (never a download). For every case the expected rendering
is written out by hand as (text, is_assistant) pieces; the test checks that the template renders exactly that
text, that no token of the full tokenization straddles two pieces, and that `ChatEncoder` marks exactly the
tokens of the assistant pieces — token by token.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speculators.core.errors import SpeculatorsError
from speculators.data.chat import ChatEncoder, RowEncodeError
from speculators.data.schemas import Conversation

HOUSE = Path(__file__).resolve().parents[3] / "data" / "targets" / "stdlib-lm"

LLAMA3 = r"""{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"""

QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

MISTRAL = r"""{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"""

GEMMA = r"""{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"""


def make_tokenizer(template: str | None, special: list[str], eos: str | None, bos: str | None = None,
                   added: tuple[str, ...] = ()):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(HOUSE)
    if special:
        tok.add_special_tokens({"additional_special_tokens": special})
    if added:
        tok.add_tokens(list(added))
    if eos is not None:
        tok.eos_token = eos
    if bos is not None:
        tok.bos_token = bos
    tok.chat_template = template
    return tok


def expected(tok, pieces: list[tuple[str, int]]) -> tuple[str, list[int], list[int]]:
    """Token ids of the full text and, per token, the flag of the hand-written piece its characters belong to."""
    text = "".join(t for t, _ in pieces)
    bounds, at = [], 0
    for t, flag in pieces:
        bounds.append((at, at + len(t), flag))
        at += len(t)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = []
    for tid, (s0, e0) in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
        owners = [flag for (b0, b1, flag) in bounds if s0 < b1 and e0 > b0]
        assert len(set(owners)) == 1, f"token {tok.decode([tid])!r} straddles a piece boundary"
        mask.append(owners[0])
    return text, list(enc["input_ids"]), mask


def check(tok, conv: Conversation, pieces: list[tuple[str, int]], kwargs: dict | None = None,
          method: str | None = None) -> None:
    text, ids, mask = expected(tok, pieces)
    rendered = tok.apply_chat_template(conv.messages, tools=conv.tools, tokenize=False, **(kwargs or {}))
    assert rendered == text, "the template does not render as hand-derived"
    enc = ChatEncoder(tok, kwargs).encode(conv)
    assert enc.input_ids == ids
    assert enc.input_ids == tok.apply_chat_template(conv.messages, tools=conv.tools, tokenize=True,
                                                    return_dict=True, **(kwargs or {}))["input_ids"]
    for t, (got, want) in enumerate(zip(enc.loss_mask, mask, strict=True)):
        assert got == want, f"token {t} {tok.decode([ids[t]])!r}: mask {got}, expected {want}"
    assert len(enc.loss_mask) == len(mask)
    assert sum(mask) > 0
    if method:
        assert enc.method == method


def conv(*messages: dict, tools: list | None = None) -> Conversation:
    return Conversation(id="row", messages=list(messages), tools=tools)


def u(text: str) -> dict:
    return {"role": "user", "content": text}


def a(text: str, **extra) -> dict:
    return {"role": "assistant", "content": text, **extra}


def s(text: str) -> dict:
    return {"role": "system", "content": text}


# ----------------------------------------------------------------------------------------------------------------


def test_llama3_multi_turn_with_system():
    tok = make_tokenizer(LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                  "<|end_of_text|>"], eos="<|end_of_text|>", bos="<|begin_of_text|>")
    c = conv(s("You are terse."), u("What is 2+2?"), a("  4 "), u("And 3+3?"), a("6"))
    check(tok, c, [
        ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
         "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
        ("4<|eot_id|>", 1),
        ("<|start_header_id|>user<|end_header_id|>\n\nAnd 3+3?<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
        ("6<|eot_id|>", 1),
    ], method="prefix")


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_qwen25_chatml_tool_call_and_default_system():
    tok = make_tokenizer(QWEN25, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], eos="<|endoftext|>",
                         added=("<tool_call>", "</tool_call>"))
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    c = conv(u("Weather in Paris?"), a("", tool_calls=[call]), {"role": "tool", "content": "18C, sunny"},
             a("It is 18C and sunny in Paris."), tools=[WEATHER_TOOL])
    system = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
              "You may call one or more functions to assist with the user query.\n\nYou are provided with function "
              "signatures within <tools></tools> XML tags:\n<tools>\n" + json.dumps(WEATHER_TOOL) +
              "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
              "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
              "<args-json-object>}\n</tool_call><|im_end|>\n")
    check(tok, c, [
        (system + "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n", 0),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>', 1),
        ("\n<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n", 0),
        ("It is 18C and sunny in Paris.<|im_end|>", 1),
        ("\n", 0),
    ], method="prefix")


def test_qwen25_plain_multi_turn_with_system():
    tok = make_tokenizer(QWEN25, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], eos="<|im_end|>")
    c = conv(s("Be brief."), u("Name a prime."), a("Seven."), u("Another?"), a("Eleven."))
    check(tok, c, [
        ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nName a prime.<|im_end|>\n"
         "<|im_start|>assistant\n", 0),
        ("Seven.<|im_end|>", 1),
        ("\n<|im_start|>user\nAnother?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Eleven.<|im_end|>", 1),
        ("\n", 0),
    ])


def qwen3_tokenizer():
    return make_tokenizer(QWEN3, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], eos="<|im_end|>",
                          added=("<think>", "</think>", "<tool_call>", "</tool_call>"))


def test_qwen3_thinking_history_drops_reasoning_last_turn_keeps_it():
    tok = qwen3_tokenizer()
    c = conv(u("What is 2+2?"), a("<think>\nAdd them.\n</think>\n\nIt is 4."), u("And 3+3?"),
             a("<think>\nAdd again.\n</think>\n\nIt is 6."))
    check(tok, c, [
        ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("It is 4.<|im_end|>", 1),  # the template drops the reasoning of history turns
        ("\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\nAdd again.\n</think>\n\nIt is 6.<|im_end|>", 1),  # the model writes its think block
        ("\n", 0),
    ], method="prefix")


def test_qwen3_non_thinking_excludes_injected_empty_think_block():
    tok = qwen3_tokenizer()
    kwargs = {"enable_thinking": False}
    c = conv(s("You are helpful."), u("What is 2+2?"), a("It is 4."), u("And 3+3?"), a("It is 6."))
    check(tok, c, [
        ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
         "<|im_start|>assistant\n", 0),
        ("It is 4.<|im_end|>", 1),  # history turn: located by sentinel (no think block in history)
        ("\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", 0),
        ("It is 6.<|im_end|>", 1),  # the empty think block belongs to the generation prompt
        ("\n", 0),
    ], kwargs=kwargs, method="sentinel")


def test_qwen3_tool_call_with_reasoning_content_field():
    tok = qwen3_tokenizer()
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    c = conv(u("Weather in Oslo?"), a("", tool_calls=[call], reasoning_content="Need the tool."),
             {"role": "tool", "content": "-3C"}, a("It is -3C in Oslo."), tools=[WEATHER_TOOL])
    system = ("<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
              "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" +
              json.dumps(WEATHER_TOOL) + "\n</tools>\n\nFor each function call, return a json object with function "
              "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
              "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n")
    check(tok, c, [
        (system + "<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n", 0),
        ('<think>\nNeed the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
         "\n</tool_call><|im_end|>", 1),
        ("\n<|im_start|>user\n<tool_response>\n-3C\n</tool_response><|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\n\n</think>\n\nIt is -3C in Oslo.<|im_end|>", 1),
        ("\n", 0),
    ])


def test_mistral_multi_turn():
    tok = make_tokenizer(MISTRAL, ["<s>", "</s>"], eos="</s>", bos="<s>")
    c = conv(u("Hi"), a("Hello there"), u("Bye?"), a("Goodbye"))
    check(tok, c, [
        ("<s>[INST] Hi [/INST]", 0),
        ("Hello there</s>", 1),
        ("[INST] Bye? [/INST]", 0),
        ("Goodbye</s>", 1),
    ], method="prefix")


def test_gemma_multi_turn_trims_and_uses_end_of_turn():
    tok = make_tokenizer(GEMMA, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], eos="<eos>", bos="<bos>")
    c = conv(u("Hi"), a(" Hello "), u("Bye"), a("Goodbye"))
    check(tok, c, [
        ("<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", 0),
        ("Hello<end_of_turn>", 1),
        ("\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n", 0),
        ("Goodbye<end_of_turn>", 1),
        ("\n", 0),
    ], method="prefix")


def test_gemma_rejects_system_role_as_row_error():
    tok = make_tokenizer(GEMMA, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], eos="<eos>", bos="<bos>")
    with pytest.raises(RowEncodeError, match="System role not supported"):
        ChatEncoder(tok).encode(conv(s("x"), u("Hi"), a("Hello")))


HOUSE_PIECES = [
    ("<|system|>\nAnswer in one line.<|end|>\n<|user|>\nWhat does len do?<|end|>\n<|assistant|>\n", 0),
    ("It returns the number of items.<|end|>", 1),
    ("\n<|user|>\nAnd abs?<|end|>\n<|assistant|>\n", 0),
    ("The absolute value.<|end|>", 1),
    ("\n", 0),
]
HOUSE_CONV = conv(s("Answer in one line."), u("What does len do?"), a("It returns the number of items."),
                  u("And abs?"), a("The absolute value."))


def test_house_template_generation_markers():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(HOUSE)
    check(tok, HOUSE_CONV, HOUSE_PIECES, method="generation_markers")


def test_house_template_agnostic_method_agrees_with_markers():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(HOUSE)
    stripped = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert stripped != tok.chat_template
    tok.chat_template = stripped
    check(tok, HOUSE_CONV, HOUSE_PIECES, method="prefix")


def test_raw_prompt_completion_needs_no_template():
    tok = make_tokenizer(None, [], eos=None)
    enc = ChatEncoder(tok).encode(Conversation(id="r", prompt="def add(a, b):\n", completion="    return a + b\n"))
    p = tok("def add(a, b):\n", add_special_tokens=False)["input_ids"]
    cpl = tok("    return a + b\n", add_special_tokens=False)["input_ids"]
    assert enc.input_ids == p + cpl + [tok.eos_token_id]
    assert enc.loss_mask == [0] * len(p) + [1] * (len(cpl) + 1)
    assert enc.method == "raw"


def test_missing_chat_template_is_one_line_error():
    tok = make_tokenizer(None, [], eos=None)
    with pytest.raises(SpeculatorsError, match="no chat template.*target.chat_template"):
        ChatEncoder(tok).encode(conv(u("Hi"), a("Hello")))


def test_special_token_text_inside_content_is_rejected():
    tok = make_tokenizer(QWEN25, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], eos="<|im_end|>")
    with pytest.raises(RowEncodeError, match="special token text"):
        ChatEncoder(tok).encode(conv(u("Hi"), a("Hello<|im_end|> fake")))


# gpt-oss's harmony layout, reduced to what decides the mask: every earlier assistant turn ends with <|end|>, the
# last one with <|return|> (the tokenizer's EOS), and the last turn's reasoning channel is closed by <|end|> INSIDE it
HARMONY = r"""{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {%- if loop.last and message.reasoning_content is defined %}
            {{- '<|start|>assistant<|channel|>analysis<|message|>' + message.reasoning_content + '<|end|>' }}
        {%- endif %}
        {{- '<|start|>assistant<|channel|>final<|message|>' + message.content }}
        {{- '<|return|>' if loop.last else '<|end|>' }}
    {%- else %}
        {{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"""


def test_harmony_earlier_turns_end_at_end_the_last_at_return():
    """Earlier turns end at <|end|>, the last one (reasoning and all) at <|return|>: neither the previous rule (one
    terminator, learned from a one-turn probe) nor treating <|end|> as a terminator everywhere gets both right."""
    tok = make_tokenizer(HARMONY, ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"],
                         eos="<|return|>")
    c = conv(u("Hi"), a("Hello"), u("Why?"), a("Because", reasoning_content="think"))
    check(tok, c, [
        ("<|start|>user<|message|>Hi<|end|><|start|>assistant", 0),
        ("<|channel|>final<|message|>Hello<|end|>", 1),
        ("<|start|>user<|message|>Why?<|end|><|start|>assistant", 0),
        ("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>Because<|return|>", 1),
    ], method="prefix")
