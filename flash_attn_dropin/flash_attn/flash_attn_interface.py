"""``flash_attn.flash_attn_interface``: the public functions, as flash-attn 2 lays them out
(``from flash_attn.flash_attn_interface import flash_attn_varlen_func`` works), and
``UnsupportedFeatureError``. Private helpers of the real module (``_flash_attn_forward``, ...)
do not exist here."""
from flash_attention_sm75.fa2 import *  # noqa: F401,F403
from flash_attention_sm75.fa2 import __all__  # noqa: F401
