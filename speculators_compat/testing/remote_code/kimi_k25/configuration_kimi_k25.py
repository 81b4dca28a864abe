"""Kimi-K2.5 configuration -- the tiny test checkpoint's stand-in for the real checkpoint's
``configuration_kimi_k25.py`` (written by speculators_compat.testing.tiny, never imported by the library).

Like moonshotai/Kimi-K2.5 it is reached through ``config.json``'s ``auto_map`` (``AutoConfig``),
so ``AutoConfig.from_pretrained(path, trust_remote_code=True)`` -- what the stock speculators
generator calls -- loads it. Same model type, classes and field names as the real one: a
DeepSeek-V3 ``text_config`` and a MoonViT ``vision_config`` whose tower fields are spelled
``vt_*``. No ``num_hidden_layers`` at the top level: the layer count lives in ``text_config``.
"""

from transformers import DeepseekV3Config
from transformers.configuration_utils import PretrainedConfig


class KimiK25VisionConfig(PretrainedConfig):
    model_type = "kimi_k25_vision"

    def __init__(
        self,
        patch_size=14,
        init_pos_emb_height=64,
        init_pos_emb_width=64,
        init_pos_emb_time=4,
        pos_emb_type="divided_fixed",
        vt_num_attention_heads=16,
        vt_num_hidden_layers=27,
        vt_hidden_size=1152,
        vt_intermediate_size=4304,
        merge_kernel_size=(2, 2),
        video_attn_type="spatial_temporal",
        merge_type="sd2_tpool",
        mm_projector_type="patchmerger",
        mm_hidden_size=None,
        projector_hidden_act="gelu",
        projector_ln_eps=1e-5,
        text_hidden_size=7168,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.patch_size = patch_size
        self.init_pos_emb_height = init_pos_emb_height
        self.init_pos_emb_width = init_pos_emb_width
        self.init_pos_emb_time = init_pos_emb_time
        self.pos_emb_type = pos_emb_type
        self.vt_num_attention_heads = vt_num_attention_heads
        self.vt_num_hidden_layers = vt_num_hidden_layers
        self.vt_hidden_size = vt_hidden_size
        self.vt_intermediate_size = vt_intermediate_size
        self.merge_kernel_size = merge_kernel_size
        self.video_attn_type = video_attn_type
        self.merge_type = merge_type
        self.mm_projector_type = mm_projector_type
        self.mm_hidden_size = vt_hidden_size if mm_hidden_size is None else mm_hidden_size
        self.projector_hidden_act = projector_hidden_act
        self.projector_ln_eps = projector_ln_eps
        self.text_hidden_size = text_hidden_size


class KimiK25Config(PretrainedConfig):
    model_type = "kimi_k25"

    def __init__(
        self,
        text_config=None,
        vision_config=None,
        ignore_index=-100,
        media_placeholder_token_id=163605,
        pad_token_id=0,
        use_unified_vision_chunk=True,
        video_placeholder="<|kimi_k25_video_placeholder|>",
        **kwargs,
    ):
        if text_config is None:
            text_config = DeepseekV3Config()
        elif isinstance(text_config, dict):
            text_config = DeepseekV3Config(**text_config)
        if vision_config is None:
            vision_config = KimiK25VisionConfig()
        elif isinstance(vision_config, dict):
            vision_config = KimiK25VisionConfig(**vision_config)
        self.text_config = text_config
        self.vision_config = vision_config
        self.ignore_index = ignore_index
        self.media_placeholder_token_id = media_placeholder_token_id
        self.use_unified_vision_chunk = use_unified_vision_chunk
        self.video_placeholder = video_placeholder
        if getattr(text_config, "quantization_config", None) is not None:
            self.quantization_config = text_config.quantization_config
        super().__init__(pad_token_id=pad_token_id, **kwargs)
