"""Write the embedded model's tokenizer (tokenizer.json, its config and chat template: ~3.5 MB) to a folder.

``model=tiny`` and the random-weight shapes (conf/model/shape_*.yaml) then build from that folder alone
(``model.tokenizer=<folder>``), without the embedded model's 98 MB GGUF: what a GPU node is sent
(bench/gpu_check.sh, docs/gpu.md). The same tokenizer gives the same token ids, so the same models.

    PYTHONPATH=. .venv/bin/python bench/export_tokenizer.py .gpu/tokenizer
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def export(out: Path, cache_dir: str) -> list[Path]:
    """The embedded tokenizer's files in ``out`` (created); returns them."""
    from transformers import AutoTokenizer

    from agl.policy.quiet import quiet_loading
    from agl.policy.weights import convert_embedded

    with quiet_loading():
        tokenizer = AutoTokenizer.from_pretrained(convert_embedded(Path(cache_dir).expanduser()))
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    return sorted(p for p in out.iterdir() if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the folder to write (created)")
    parser.add_argument("--cache-dir", default=os.environ.get("AGL_CACHE", "~/.cache/agl"))
    args = parser.parse_args()
    for path in export(args.out, args.cache_dir):
        print(f"{path.stat().st_size / 2**20:7.2f} MiB  {path}")


if __name__ == "__main__":
    main()
