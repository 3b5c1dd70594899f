"""`kestrel-appliance convert HF_DIR OUT.gguf --type q8_0|q4_0|f16|f32`: quantize a Hugging Face checkpoint once,
on any machine, into a GGUF file that both this engine and llama.cpp load.

Policies:
- This module reads config.json and dispatches on `model_type`: text checkpoints (qwen3, qwen2, llama,
  qwen3_moe) to text.py, vision-language ones (qwen3_vl, qwen3_vl_moe) to vl.py, which writes the text file
  plus mmproj-OUT.gguf and shares text.py's plan, types and writer. Anything else is refused by name.
- Bad input is a one-line error and exit status 2; a failed run leaves no OUT.gguf (each file is written to a
  .tmp beside it and renamed when whole).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .text import ARCHITECTURES, TYPES, ConvertError, convert_text
from .vl import MMPROJ_TYPES, VL_ARCHITECTURES, convert_vl

__all__ = ["ConvertError", "convert", "convert_files", "main"]


def convert(model_dir: str, out_path: str, type_name: str, progress_stream=None, mmproj_type: str | None = None) -> str:
    """Write OUT.gguf (and for a Qwen3-VL checkpoint mmproj-OUT.gguf beside it); returns out_path."""
    return convert_files(model_dir, out_path, type_name, progress_stream, mmproj_type)[0]


def convert_files(model_dir: str, out_path: str, type_name: str, progress_stream=None,
                  mmproj_type: str | None = None) -> list[str]:
    """The files written: [OUT.gguf], or for a Qwen3-VL checkpoint [OUT.gguf, mmproj-OUT.gguf]."""
    if type_name not in TYPES:
        raise ConvertError(f"unknown type {type_name!r} (choose from {', '.join(TYPES)})")
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConvertError(f"no config.json in {model_dir}")
    with open(cfg_path, encoding="utf-8") as f:
        cfg_dict = json.load(f)
    if cfg_dict.get("model_type") in VL_ARCHITECTURES:
        return list(convert_vl(model_dir, out_path, type_name, cfg_dict, mmproj_type or "f16", progress_stream))
    if mmproj_type is not None:
        raise ConvertError(f"--mmproj-type is for vision-language checkpoints ({', '.join(VL_ARCHITECTURES)}); "
                           f"{cfg_dict.get('model_type')!r} has no vision tower")
    if cfg_dict.get("model_type") not in ARCHITECTURES:
        supported = ", ".join(ARCHITECTURES + tuple(VL_ARCHITECTURES))
        raise ConvertError(f"unsupported model type {cfg_dict.get('model_type')!r} (supported: {supported})")
    return convert_text(model_dir, out_path, type_name, cfg_dict, progress_stream)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kestrel-appliance convert",
                                description="Convert a Hugging Face checkpoint directory to a GGUF file.")
    p.add_argument("model_dir", metavar="HF_DIR")
    p.add_argument("out", metavar="OUT.gguf")
    p.add_argument("--type", default="q8_0", choices=sorted(TYPES), help="weight type of the matrices")
    p.add_argument("--mmproj-type", default=None, choices=sorted(MMPROJ_TYPES),
                   help="Qwen3-VL only: weight type of the vision projector's matrices, written to mmproj-OUT.gguf "
                        "beside OUT.gguf (default f16)")
    args = p.parse_args(argv)
    try:
        paths = convert_files(args.model_dir, args.out, args.type, mmproj_type=args.mmproj_type)
    except (ConvertError, OSError, ValueError, KeyError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"kestrel-appliance convert: error: {msg}", file=sys.stderr)
        try:
            os.remove(args.out + ".tmp")
        except OSError:
            pass
        return 2
    print("\n".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
