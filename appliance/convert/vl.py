"""`kestrel-appliance convert` for Qwen3-VL (`qwen3_vl`) and Qwen3-VL-MoE (`qwen3_vl_moe`) checkpoints: the pair
llama.cpp's converter makes (convert_hf_to_gguf.py, and again with `--mmproj`), which llama.cpp's mtmd
(`llama-server --mmproj`) and our gguf_vl loader both take.

Policies:
- Two files: OUT.gguf, the text decoder (`general.architecture` qwen3vl / qwen3vlmoe): text.py's Qwen3 /
  Qwen3-MoE keys, tokenizer and tensor plan over the decoder's names (`model.language_model.`), plus
  `rope.dimension_sections` (t, h, w, 0) and `n_deepstack_layers`; and mmproj-OUT.gguf beside it, the vision
  tower (`general.architecture` clip, `general.type` mmproj, projector `qwen3vl_merger`, DeepStack flags per
  vision layer, image size/patch/merge, mean/std from preprocessor_config.json). Keys and names are llama.cpp's
  (its Qwen3VLVisionModel / Qwen3VLTextModel / Qwen3VLMoeTextModel); the name table is engine/load/names.py.
- llama.cpp's choices carried over: `clip.vision.image_size` = sqrt(num_position_embeddings) * patch; the
  vision LayerNorm epsilon written is the text config's rms_norm_eps; `clip.use_gelu` (the tanh GELU); the
  Conv3d patch kernel (hidden, C, 2, p, p) becomes two Conv2d kernels, `v.patch_embd.weight` (frame 0) and
  `.weight.1` (frame 1); the final merger's fc1/fc2 are `mm.0`/`mm.2`, its norm `v.post_ln`; DeepStack merger
  J is named by the vision layer it follows (`v.deepstack.L.*`).
- Types: the text side as text.py (`--type`). The projector (`--mmproj-type`, f16 by default, q8_0, f32):
  2-D matrices get it (F16 where a row is not a whole number of blocks), norms and biases F32, the position
  table F32, the patch kernels F16 in an f16 file and F32 otherwise (llama.cpp's tensor_force_quant).
- Qwen3-VL-MoE: the router always renormalises the top-k weights (the config does not say); every layer must
  be sparse (llama.cpp's qwen3vlmoe has no dense layers). Fused experts in either layout (text.expert_sources).
- The tower's tensors are checked against vision_config before anything is written (vision_check.py); each
  file is written tensor by tensor to a .tmp beside it and renamed when whole; a failure removes both .tmp files.
"""
from __future__ import annotations

import json
import math
import os

from .text import (
    FILE_TYPES,
    TYPES,
    ConvertError,
    Source,
    tensor_plan,
    text_types,
    write_hparams,
    write_tensors,
    write_tokenizer,
)

VL_ARCHITECTURES = {"qwen3_vl": "qwen3vl", "qwen3_vl_moe": "qwen3vlmoe"}  # Hugging Face -> llama.cpp
MMPROJ_TYPES = ("f16", "q8_0", "f32")


def mmproj_path_for(out_path: str) -> str:
    """mmproj-OUT.gguf beside OUT.gguf (the name gguf_vl.find_mmproj picks up when --mmproj is not given)."""
    return os.path.join(os.path.dirname(os.path.abspath(out_path)), "mmproj-" + os.path.basename(out_path))


def _prefix(st, *candidates: str) -> str:
    for p in candidates:
        if any(k.startswith(p) for k in st.keys()):
            return p
    raise ConvertError(f"no tensors under {' or '.join(candidates)} in {st.model_dir}")


def text_config(cfg_dict: dict):
    """(Qwen3Config, MoEConfig or None, M-RoPE sections (t, h, w)) of the decoder, from config.json's text_config."""
    from appliance.engine.config import Qwen3Config

    text_d = dict(cfg_dict.get("text_config") or {})
    if "tie_word_embeddings" in cfg_dict:
        text_d["tie_word_embeddings"] = cfg_dict["tie_word_embeddings"]
    rope = text_d.get("rope_parameters") or text_d.get("rope_scaling") or {}
    sections = tuple(int(x) for x in rope.get("mrope_section", (24, 20, 20)))
    cfg = Qwen3Config.from_dict({**text_d, "model_type": "qwen3"})
    if len(sections) != 3 or sum(sections) != cfg.head_dim // 2:
        raise ConvertError(f"mrope_section {list(sections)} does not cover head_dim {cfg.head_dim}")
    moe = None
    if cfg_dict["model_type"] == "qwen3_vl_moe":
        from appliance.engine.qwen3_moe import MoEConfig

        moe = MoEConfig.from_dict({**text_d, "norm_topk_prob": True})
        if moe.mlp_only_layers or moe.decoder_sparse_step != 1:
            raise ConvertError("llama.cpp's qwen3vlmoe has no dense layers: only checkpoints with every layer "
                               "sparse can be converted")
    return cfg, moe, sections


def vision_plan(st, vcfg, prefix: str, mmproj_type: str) -> list[tuple[str, Source, str]]:
    """(mmproj name, Source, type) for every tensor of the tower, in the order llama.cpp's converter writes."""
    from appliance.engine.load.names import (
        MERGER_TENSORS,
        VISION_BLOCK_TENSORS,
        VISION_PATCH,
        VISION_POS,
        gguf_merger,
        gguf_vision_block,
    )

    matrix = TYPES[mmproj_type]
    plan = []

    def add(gg: str, hf: str) -> None:  # a Linear / LayerNorm's .weight and .bias
        for part in ("weight", "bias"):
            plan.append((f"{gg}.{part}", Source((f"{hf}.{part}",)), matrix if part == "weight" else "F32"))

    for i in range(vcfg.depth):
        for role, (hf_name, _) in VISION_BLOCK_TENSORS.items():
            add(gguf_vision_block(i, role), f"{prefix}blocks.{i}.{hf_name}")
    for j, layer in enumerate(vcfg.deepstack_visual_indexes):
        for role, (hf_name, _) in MERGER_TENSORS.items():
            add(gguf_merger(role, layer), f"{prefix}deepstack_merger_list.{j}.{hf_name}")
    for role, (hf_name, _) in MERGER_TENSORS.items():
        add(gguf_merger(role), f"{prefix}merger.{hf_name}")
    kernel = prefix + "patch_embed.proj.weight"  # (hidden, C, 2, p, p)
    frames = "F16" if mmproj_type == "f16" else "F32"
    plan += [(VISION_PATCH + ".bias", Source((prefix + "patch_embed.proj.bias",)), "F32"),
             (VISION_PATCH + ".weight", Source((kernel,), frame=0), frames),
             (VISION_PATCH + ".weight.1", Source((kernel,), frame=1), frames),
             (VISION_POS, Source((prefix + "pos_embed.weight",)), "F32")]
    # LayerNorm weights are 1-D: F32 whatever `matrix` says (encode_tensor keeps 1-D tensors F32)
    return plan


def write_mmproj_metadata(writer, vcfg, preprocessor: dict, text_hidden: int, text_eps: float, name: str,
                          mmproj_type: str) -> None:
    import gguf

    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name(name)
    writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[mmproj_type]))
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(text_hidden)
    writer.add_vision_image_size(int(math.isqrt(vcfg.num_position_embeddings) * vcfg.patch_size))
    writer.add_vision_patch_size(vcfg.patch_size)
    writer.add_vision_embedding_length(vcfg.hidden_size)
    writer.add_vision_feed_forward_length(vcfg.intermediate_size)
    writer.add_vision_block_count(vcfg.depth)
    writer.add_vision_head_count(vcfg.num_heads)
    writer.add_vision_image_mean([float(x) for x in preprocessor["image_mean"]])
    writer.add_vision_image_std([float(x) for x in preprocessor["image_std"]])
    writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN3VL)
    writer.add_vision_use_gelu(True)
    writer.add_vision_spatial_merge_size(vcfg.spatial_merge_size)
    writer.add_vision_attention_layernorm_eps(text_eps)
    writer.add_vision_is_deepstack_layers([i in vcfg.deepstack_visual_indexes for i in range(vcfg.depth)])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def check_tower(st, vcfg, prefix: str) -> None:
    """ConvertError (one line) unless the checkpoint's tower has the tensors and shapes vision_config gives."""
    from appliance.engine.load import ModelFileError
    from appliance.engine.load.vision_check import check_vision_config, check_vision_tensors, hf_vision_shapes

    where = f"{st.model_dir}: the vision tower"
    try:
        check_vision_config(where, vcfg)
        check_vision_tensors(where, lambda n: tuple(st.info(n)[0]) if n in st else None,
                             hf_vision_shapes(vcfg, prefix), "config.json's vision_config")
    except ModelFileError as e:
        raise ConvertError(str(e)) from None
    if vcfg.temporal_patch_size != 2:
        raise ConvertError("llama.cpp's Qwen3-VL patch embedding needs temporal_patch_size 2")
    if vcfg.hidden_act != "gelu_pytorch_tanh":
        raise ConvertError(f"vision activation {vcfg.hidden_act!r}: llama.cpp's Qwen3-VL projector runs the tanh "
                           "GELU (gelu_pytorch_tanh) only")


def convert_vl(model_dir: str, out_path: str, type_name: str, cfg_dict: dict, mmproj_type: str = "f16",
               progress_stream=None) -> tuple[str, str]:
    """Write OUT.gguf and mmproj-OUT.gguf from a qwen3_vl / qwen3_vl_moe directory; returns both paths."""
    import gguf

    from appliance.engine.load.names import HFNames
    from appliance.engine.safetensors import SafeTensors
    from appliance.engine.vision import VisionConfig

    if mmproj_type not in MMPROJ_TYPES:
        raise ConvertError(f"unknown --mmproj-type {mmproj_type!r} (choose from {', '.join(MMPROJ_TYPES)})")
    cfg, moe, sections = text_config(cfg_dict)
    try:
        vcfg = VisionConfig.from_dict(cfg_dict["vision_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConvertError(f"config.json's vision_config: {e}") from None
    if vcfg.out_hidden_size != cfg.hidden_size:
        raise ConvertError(f"vision out_hidden_size {vcfg.out_hidden_size} differs from the text hidden_size "
                           f"{cfg.hidden_size}")
    pp_path = os.path.join(model_dir, "preprocessor_config.json")
    if not os.path.isfile(pp_path):
        raise ConvertError(f"no preprocessor_config.json in {model_dir} (the image mean/std come from it)")
    with open(pp_path, encoding="utf-8") as f:
        preprocessor = json.load(f)
    st = SafeTensors(model_dir)
    names = HFNames(_prefix(st, "model.language_model.", "language_model.model.", "model."))
    vprefix = _prefix(st, "model.visual.", "visual.")
    check_tower(st, vcfg, vprefix)
    mmproj_out = mmproj_path_for(out_path)
    name = os.path.basename(os.path.abspath(model_dir))
    arch = VL_ARCHITECTURES[cfg_dict["model_type"]]
    tmps = (out_path + ".tmp", mmproj_out + ".tmp")
    try:
        writer = gguf.GGUFWriter(tmps[0], arch)
        writer.add_type(gguf.GGUFType.MODEL)
        write_hparams(writer, cfg, name, FILE_TYPES[type_name], moe)
        writer.add_rope_dimension_sections([*sections, 0])
        writer.add_num_deepstack_layers(len(vcfg.deepstack_visual_indexes))
        write_tokenizer(writer, model_dir, cfg.vocab_size, {**cfg_dict, **(cfg_dict.get("text_config") or {})})
        write_tensors(writer, text_types(tensor_plan(st, cfg, moe, names), TYPES[type_name]), st, cfg,
                      progress_stream)
        writer = gguf.GGUFWriter(tmps[1], "clip")
        write_mmproj_metadata(writer, vcfg, preprocessor, cfg.hidden_size, cfg.rms_norm_eps, name, mmproj_type)
        write_tensors(writer, vision_plan(st, vcfg, vprefix, mmproj_type), st, cfg, progress_stream)
    except BaseException:
        for tmp in tmps:
            try:
                os.remove(tmp)
            except OSError:
                pass
        raise
    os.replace(tmps[0], out_path)
    os.replace(tmps[1], mmproj_out)
    return out_path, mmproj_out
