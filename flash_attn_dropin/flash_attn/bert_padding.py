"""``flash_attn.bert_padding``: pad_input, unpad_input (five return values, as flash-attn 2.7+),
index_first_axis, index_put_first_axis, unpad_input_for_concatenated_sequences, from
``flash_attention_sm75.bert_padding``."""
from flash_attention_sm75.bert_padding import *  # noqa: F401,F403
from flash_attention_sm75.bert_padding import __all__  # noqa: F401
