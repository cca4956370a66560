"""Export a checkpoint as a Hugging Face model (safetensors + tokenizer), ZeRO-3 shards included.

python scripts/export_checkpoint.py runs/tiny/checkpoints/step_00000150 exported/tiny-150
python scripts/export_checkpoint.py runs/tiny/checkpoints/step_00000150 exported/tiny-150-merged --merged
python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('exported/tiny-150')"
"""

from __future__ import annotations

import argparse

from pretrainer.cli import run_main, script_parser


def parse_args(argv=None) -> argparse.Namespace:
    p = script_parser(__doc__, recipe=False)
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--merged", action="store_true", help="the averaged weights (recipe `averaging`), not the live ones"
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def run() -> int:
        from pretrainer.checkpoint.export import export_checkpoint

        print(export_checkpoint(args.checkpoint, args.out, args.dtype, args.merged))
        return 0

    return run_main(run, debug=args.debug)


if __name__ == "__main__":
    raise SystemExit(main())
