"""Export a checkpoint as a Hugging Face model (safetensors + tokenizer), ZeRO-3 shards included.

python scripts/export_checkpoint.py runs/tiny/checkpoints/step_00000150 exported/tiny-150
python scripts/export_checkpoint.py runs/tiny/checkpoints/step_00000150 exported/tiny-150-merged --merged
python scripts/export_checkpoint.py runs/tiny/checkpoints/step_00000220 exported/tiny --push-to-hub me/tiny-220
python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('exported/tiny-150')"

--push-to-hub writes a model card from the run (recipe, tokens, final val/ref, lm-eval scores, incidents) into OUT
and uploads OUT through huggingface_hub (private unless --public; the token: HF_TOKEN or `huggingface-cli login`).
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
    p.add_argument("--push-to-hub", metavar="REPO", help="then upload OUT, with a model card, to this Hub repo")
    p.add_argument("--public", action="store_true", help="with --push-to-hub: a public repo (default: private)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def run() -> int:
        from pretrainer.checkpoint.export import export_checkpoint
        from pretrainer.noise import quiet_bars_in_files

        quiet_bars_in_files()

        out = export_checkpoint(args.checkpoint, args.out, args.dtype, args.merged)
        print(out)
        if args.push_to_hub:
            from pretrainer.publishing.hub import push_to_hub

            print(push_to_hub(out, args.push_to_hub, private=not args.public))
        return 0

    return run_main(run, debug=args.debug)


if __name__ == "__main__":
    raise SystemExit(main())
