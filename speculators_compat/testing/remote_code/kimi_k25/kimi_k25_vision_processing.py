"""Kimi-K2.5 media processor -- the tiny test checkpoint's stand-in for the real checkpoint's
``kimi_k25_vision_processing.py`` (written by speculators_compat.testing.tiny, never imported by the library).

Reached like the real one through ``preprocessor_config.json``'s ``auto_map``
(``AutoImageProcessor``): vLLM's Kimi-K2.5 processing (``KimiK25ProcessingInfo``) loads it with
``trust_remote_code=True`` in the driver (encoder budget) and in every worker (profiling with a
dummy image). It has what vLLM calls: ``media_tokens_calculator``, ``preprocess``,
``split_video_chunks`` and ``num_frames_per_chunk``, with the real processor's NaViT sizing
(scale the media to at most ``in_patch_limit`` patches and ``patch_limit_on_one_side`` patches a
side, pad to the merge kernel, one token per merged ``2 x 2`` patch; a video chunk's frames are
pooled into one set of tokens). Video decoding (the real one reads video bytes with an internal
reader) is not included: ``split_video_chunks`` takes decoded frames.
"""

import math

import numpy as np
import torch
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature


def _field(item, name):
    return item[name] if isinstance(item, dict) else getattr(item, name)


def navit_resize(width, height, patch_size, merge_kernel_size, in_patch_limit, patch_limit_on_one_side):
    """Target size, padding and token count of one image (or one frame of a video chunk)."""
    scale = min(
        1.0,
        math.sqrt(in_patch_limit / (max(1.0, width // patch_size) * max(1.0, height // patch_size))),
        patch_limit_on_one_side * patch_size / width,
        patch_limit_on_one_side * patch_size / height,
    )
    side = patch_limit_on_one_side * patch_size
    new_w = min(max(1, int(width * scale)), side)
    new_h = min(max(1, int(height * scale)), side)
    factor = merge_kernel_size * patch_size
    pad_w = (factor - new_w % factor) % factor
    pad_h = (factor - new_h % factor) % factor
    tokens = ((new_h + pad_h) // factor) * ((new_w + pad_w) // factor)
    return {"new_width": new_w, "new_height": new_h, "pad_width": pad_w, "pad_height": pad_h, "num_tokens": tokens}


class KimiK25VisionProcessor(BaseImageProcessor):
    model_type = "kimi_k25"

    def __init__(self, media_proc_cfg, **kwargs):
        super().__init__(**kwargs)
        self.media_proc_cfg = dict(media_proc_cfg)
        self.num_frames_per_chunk = self.media_proc_cfg["temporal_merge_kernel_size"]

    def _merge(self):
        merge = self.media_proc_cfg["merge_kernel_size"]
        return merge[0] if isinstance(merge, (list, tuple)) else merge

    def get_resize_config(self, media):
        cfg = self.media_proc_cfg
        kind = _field(media, "type")
        if kind == "image":
            width, height = _field(media, "image").size
            limit = cfg["in_patch_limit"]
        elif kind == "video_chunk":
            width, height = _field(media, "video_chunk")[0].size
            limit = cfg.get("in_patch_limit_each_frame") or cfg["in_patch_limit"]
        else:
            raise ValueError(f"unsupported media type {kind!r}")
        return navit_resize(width, height, cfg["patch_size"], self._merge(), limit, cfg["patch_limit_on_one_side"])

    def media_tokens_calculator(self, media):
        return self.get_resize_config(media)["num_tokens"]

    def split_video_chunks(self, video):
        if isinstance(video, (str, bytes)):
            raise NotImplementedError("the tiny Kimi-K2.5 checkpoint has no video decoder: pass decoded frames")
        frames = list(video)
        step = self.num_frames_per_chunk
        return [{"type": "video_chunk", "video_chunk": frames[i : i + step]} for i in range(0, len(frames), step)]

    def _pixels(self, image, resize):
        image = image.convert("RGB").resize((resize["new_width"], resize["new_height"]))
        array = np.asarray(image, dtype=np.float32) / 255.0
        array = np.pad(array, ((0, resize["pad_height"]), (0, resize["pad_width"]), (0, 0)))
        mean = np.asarray(self.media_proc_cfg["image_mean"], dtype=np.float32)
        std = np.asarray(self.media_proc_cfg["image_std"], dtype=np.float32)
        return (array - mean) / std

    def preprocess(self, medias, return_tensors=None):
        if not isinstance(medias, list):
            medias = [medias]
        if not medias:
            return BatchFeature(data={}, tensor_type=return_tensors)
        ps = self.media_proc_cfg["patch_size"]
        patches, grids = [], []
        for media in medias:
            resize = self.get_resize_config(media)
            frames = [_field(media, "image")] if _field(media, "type") == "image" else _field(media, "video_chunk")
            video = np.stack([self._pixels(frame, resize) for frame in frames])  # T, H, W, C
            t, h, w, c = video.shape
            grid = video.reshape(t, h // ps, ps, w // ps, ps, c).transpose(0, 1, 3, 5, 2, 4)
            patches.append(torch.from_numpy(np.ascontiguousarray(grid.reshape(-1, c, ps, ps))))
            grids.append(torch.tensor([t, h // ps, w // ps], dtype=torch.int64))
        data = {"pixel_values": torch.cat(patches), "grid_thws": torch.stack(grids)}
        return BatchFeature(data=data, tensor_type=return_tensors)

    def to_dict(self):
        output = super().to_dict()
        output["media_proc_cfg"] = self.media_proc_cfg
        return output

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        config = dict(config_dict)
        media_proc_cfg = config.pop("media_proc_cfg", {})
        return cls(media_proc_cfg=media_proc_cfg, **config, **kwargs)
