"""``flash_attn.flash_attn_interface``: the public functions, as flash-attn 2 lays them out
(``from flash_attn.flash_attn_interface import flash_attn_varlen_func`` works). Private helpers
of the real module (``_flash_attn_forward``, ...) do not exist here."""
from flash_attention_sm75.fa2 import (  # noqa: F401
    UnsupportedFeatureError,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
