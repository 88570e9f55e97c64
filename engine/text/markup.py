"""DeepSeek's chat markup, as its tokenizers spell it (DeepSeek-V3.1 layout for tool calls).

One owner for these strings: the tiny tokenizer's chat template writes them, the gateway's
reasoning and tool-call parsers read them back out of generated text.

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"json": "arguments"}<｜tool▁call▁end｜>
        ... more calls, no separator ...<｜tool▁calls▁end｜>
    <｜tool▁output▁begin｜>result text<｜tool▁output▁end｜>      (one per tool message)
    <｜deepseek_image｜>                                         (one per image; the engine expands it)
"""

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
TOOL_CALLS_END = "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN = "<｜tool▁call▁begin｜>"
TOOL_CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
TOOL_OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
TOOL_OUTPUT_END = "<｜tool▁output▁end｜>"
IMAGE = "<｜deepseek_image｜>"  # V4.1: one per image in the prompt (a special token)
