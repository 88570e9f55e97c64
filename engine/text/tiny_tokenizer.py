"""A small byte-level BPE tokenizer for tiny checkpoints, trained on a built-in corpus.

Deterministic: the corpus comes from a seeded generator and BPE training breaks ties by
pair order, so the same call gives the same tokenizer.json bytes in any process. Control tokens
follow DeepSeek's spelling and take the first ids:

    0 <｜begin▁of▁sentence｜>   1 <｜end▁of▁sentence｜>   2 <｜▁pad▁｜>
    3 <｜User｜>   4 <｜Assistant｜>   5 <think>   6 </think>
    7 <｜tool▁calls▁begin｜>   8 <｜tool▁calls▁end｜>   9 <｜tool▁call▁begin｜>
    10 <｜tool▁call▁end｜>   11 <｜tool▁sep｜>   12 <｜tool▁output▁begin｜>   13 <｜tool▁output▁end｜>

As in DeepSeek's own tokenizers, the think and tool markers (5-13) are added tokens that are not
"special": decoding keeps them in the text, which is where the reasoning and tool-call parsers
find them. The chat template's tool sections follow DeepSeek-V3.1's: tools are described after
the system prompt, a call is ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>JSON<｜tool▁call▁end｜>``
inside ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``, and each tool result is wrapped in
``<｜tool▁output▁begin｜>...<｜tool▁output▁end｜>``, after which the assistant's turn goes on.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from deepinfer.engine.text.markup import (
    ASSISTANT,
    BOS,
    END_THINK,
    EOS,
    IMAGE,
    PAD,
    THINK,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_OUTPUT_BEGIN,
    TOOL_OUTPUT_END,
    TOOL_SEP,
    USER,
)

MARKUP_TOKENS = (THINK, END_THINK, TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_SEP,
                 TOOL_OUTPUT_BEGIN, TOOL_OUTPUT_END)  # added tokens that decode as text
SPECIAL_TOKENS = (BOS, EOS, PAD, USER, ASSISTANT, *MARKUP_TOKENS)  # every added token, in id order

# Text goes out through {{ '...' }} so that block tags (trim_blocks) never eat its newlines.
_TOOLS_SECTION = (
    "{%- if tools %}{{ '\\n\\n## Tools\\nYou have access to the following tools:\\n' }}"
    "{%- for tool in tools %}{%- set f = tool['function'] if tool['function'] is defined else tool %}"
    "{{ '\\n### ' + f['name'] + '\\nDescription: ' + (f['description'] or '' if f['description'] is defined else '')"
    " + '\\n\\nParameters: ' + ((f['parameters'] or {}) if f['parameters'] is defined else {}) | tojson + '\\n' }}"
    "{%- endfor %}"
    "{{ '\\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\\n"
    + TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "tool_call_name" + TOOL_SEP + "tool_call_arguments" + TOOL_CALL_END
    + "{additional_tool_calls}" + TOOL_CALLS_END + "\\n\\nWhere:\\n"
    "- `tool_call_name` must be an exact match to one of the available tools\\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool\\'s Parameters Schema\\n"
    "- For multiple tool calls, chain them directly without separators or spaces' }}"
    "{%- endif %}"
)
# an assistant turn's calls; arguments arrive as a JSON string (OpenAI) or an object
_ASSISTANT_TOOL_CALLS = (
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}" + TOOL_CALLS_BEGIN +
    "{%- for call in message['tool_calls'] %}{%- set f = call['function'] %}" + TOOL_CALL_BEGIN +
    "{{ f['name'] }}" + TOOL_SEP +
    "{{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}" + TOOL_CALL_END +
    "{%- endfor %}" + TOOL_CALLS_END + "{%- endif %}"
)

# a message's content: a string, or a list of parts ({"type": "text", "text": ...} or
# {"type": "image"}, each image one IMAGE marker that the engine expands to the image's span)
_CONTENT = (
    "{%- macro content(value) %}{%- if value is string %}{{ value }}{%- else %}"
    "{%- for part in value %}{%- if part['type'] == 'image' %}" + IMAGE + "{%- else %}{{ part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{%- endmacro %}"
)

# DeepSeek-style chat: system prompts (and the tools) first, no marker, then role-marked turns; an
# assistant turn ends with EOS. Non-thinking generation opens the answer with </think>. Tool
# results follow the call that asked for them, and the assistant's turn continues after them
# without a new marker (DeepSeek-V3.1's layout).
CHAT_TEMPLATE = (
    _CONTENT + "{{ bos_token }}"
    "{%- for message in messages if message['role'] == 'system' %}{{ content(message['content']) }}{%- endfor %}"
    + _TOOLS_SECTION +
    "{%- set ns = namespace(after_tool=false) %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}" + USER + "{{ content(message['content']) }}{%- set ns.after_tool = false %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- if not ns.after_tool %}" + ASSISTANT + END_THINK + "{%- endif %}"
    "{{ message['content'] if message['content'] is not none else '' }}" + _ASSISTANT_TOOL_CALLS + EOS +
    "{%- set ns.after_tool = false %}"
    "{%- elif message['role'] == 'tool' %}" + TOOL_OUTPUT_BEGIN + "{{ message['content'] }}" + TOOL_OUTPUT_END +
    "{%- set ns.after_tool = true %}"
    "{%- elif message['role'] != 'system' %}{{ raise_exception('unsupported chat role: ' + message['role']) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt and not ns.after_tool %}" + ASSISTANT +
    "{%- if thinking is defined and thinking %}" + THINK + "{%- else %}" + END_THINK + "{%- endif %}"
    "{%- endif %}"
)

_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part over new sound take only little work know place year live me back give most very "
    "after thing our just name good sentence man think say great where help through much before line right "
    "too mean old any same tell boy follow came want show also around form three small set put end does "
    "another well large must big even such because turn here why ask went men read need land different home "
    "us move try kind hand picture again change off play spell air away animal house point page letter "
    "mother answer found study still learn should world high every near add food between own below country "
    "plant last school father keep tree never start city earth eye light thought head under story saw left "
    "model cache token block prefix decode prefill expert layer window attention compress index stream "
    "server request batch schedule sample memory device kernel tensor weight gradient value query key"
).split()
_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "sh", "ch", "st", "qu", "ng"]
_CODE = (
    "def {f}({a}, {b}):\n    return {a} + {b} * {n}\n",
    "for {a} in range({n}):\n    {f}({a})\n",
    "if {a} == {n}:\n    print(\"{w}\")\nelse:\n    {b} = [{n}, {m}]\n",
    "{{\"{w}\": {n}, \"{f}\": [{m}, \"{a}\"]}}\n",
    "const {f} = ({a}) => {a}.map(x => x * {n});\n",
)
_UNICODE = (
    "中文 模型 推理 缓存 专家 注意力 窗口 压缩 你好 世界 今天 天气 很好 我们 他们 学习 数据 计算",
    "日本語 こんにちは ありがとう カタカナ ひらがな 東京 モデル",
    "Привет мир модель данные кэш внимание",
    "Καλημέρα κόσμε μοντέλο",
    "café naïve résumé über straße façade jalapeño Ångström",
    "emoji 😀 🚀 🎉 👍 ❤️ 🌍 🤖 ✨",
    "math ∑ ∫ √ ∞ ≤ ≥ ≠ π λ → ← ×",
)


def corpus(num_lines: int = 12000, seed: int = 1234) -> list[str]:
    """Deterministic mixed text: English-like sentences, pseudo-words, numbers, code, other scripts."""
    rng = random.Random(seed)

    def pseudo_word() -> str:
        return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))

    lines = []
    for i in range(num_lines):
        kind = i % 10
        if kind < 5:
            words = [rng.choice(_WORDS) if rng.random() < 0.8 else pseudo_word() for _ in range(rng.randint(4, 16))]
            words[0] = words[0].capitalize()
            lines.append(" ".join(words) + rng.choice(".!?,;:") + "\n")
        elif kind < 7:
            lines.append(" ".join(pseudo_word() for _ in range(rng.randint(3, 10))) + "\n")
        elif kind == 7:
            nums = [str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(rng.randint(2, 8))]
            lines.append(" ".join(nums) + (" = " + str(rng.randint(0, 9999)) if rng.random() < 0.5 else "") + "\n")
        elif kind == 8:
            lines.append(rng.choice(_CODE).format(
                f=pseudo_word(), a=rng.choice(_WORDS), b=pseudo_word(), w=rng.choice(_WORDS),
                n=rng.randint(0, 999), m=rng.randint(0, 99)))
        else:
            text = rng.choice(_UNICODE).split()
            lines.append(" ".join(rng.choice(text) for _ in range(rng.randint(2, 8))) + "\n")
    return lines


def build_tokenizer(vocab_size: int = 4096) -> Tokenizer:
    """Train the tiny byte-level BPE (added tokens at ids 0..13; the markup ones not special)."""
    return train_bpe(corpus(), vocab_size, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))


def train_bpe(documents: Iterable[str], vocab_size: int, pre_tokenizer: pre_tokenizers.PreTokenizer) -> Tokenizer:
    """A byte-level BPE over ``documents`` to ``vocab_size`` tokens: the control tokens first
    (``SPECIAL_TOKENS``, the markup ones decoding as text), BOS before every sequence."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]),
    ])
    # the trainer makes every added token special; the markup ones decode as text
    data = json.loads(tokenizer.to_str())
    for added in data["added_tokens"]:
        if added["content"] in MARKUP_TOKENS:
            added["special"] = False
    return Tokenizer.from_str(json.dumps(data, ensure_ascii=False))


def write_tokenizer_files(out_dir: str | Path, tokenizer: Tokenizer, model_max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json (chat template, bos/eos/pad) as transformers reads them."""
    out = Path(out_dir)
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
