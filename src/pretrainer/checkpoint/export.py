"""Export any checkpoint (single-process, DDP, FSDP or DeepSpeed ZeRO shards) as a `save_pretrained` model."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..errors import PretrainerError
from . import pieces, read_meta, verify
from .identity import check_export_target, provenance, write_provenance
from .safe_load import weights_only


def checkpoint_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """The full fp32 weights of a checkpoint, gathered from ZeRO shards when DeepSpeed wrote it."""
    single = sorted(ckpt.glob("model*.safetensors"))
    if single:
        state: dict[str, torch.Tensor] = {}
        for f in single:
            state.update(load_file(str(f)))
        return state
    zero_dirs = [d for d in ckpt.iterdir() if d.is_dir() and (d / "latest").exists()] + (
        [ckpt] if (ckpt / "latest").exists() else []
    )
    if zero_dirs:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with weights_only(str(ckpt)):
            return get_fp32_state_dict_from_zero_checkpoint(str(zero_dirs[0]))
    raise PretrainerError(f"{ckpt}: no model weights found (model*.safetensors or a DeepSpeed checkpoint)")


def _dcp_state_dict(ckpt: Path, model) -> dict[str, torch.Tensor]:
    """The model weights of an FSDP/DCP checkpoint, read into a full model in this one process (no optimizer)."""
    import torch.distributed.checkpoint as dcp

    state = {"model": {k: v for k, v in model.state_dict().items()}}
    dcp.load(state, checkpoint_id=str(ckpt / "dcp"), no_dist=True)
    return state["model"]


def merged_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """The averaged weights a checkpoint holds (recipe `averaging`), assembled from every rank's pieces."""
    directory = ckpt / "averaging" / "merged"
    if not directory.is_dir():
        raise PretrainerError(
            f"{ckpt}: no averaged weights (averaging/merged/): the run had averaging off, or saved this checkpoint "
            "before averaging began"
        )
    reader = pieces.Reader(directory)
    return {name: reader.full(name) for name in reader.names()}


def export_checkpoint(ckpt: str | Path, out: str | Path, dtype: str = "float32", merged: bool = False) -> Path:
    """Write `out/` with config (RoPE as trained), safetensors weights and the tokenizer; `merged`: the averaged
    weights instead of the live ones."""
    ckpt, out = Path(ckpt), Path(out)
    if problems := verify(ckpt):
        raise PretrainerError(f"{ckpt}: does not verify: {'; '.join(problems[:3])}")
    meta = read_meta(ckpt)
    check_export_target(out, meta.get("run_id"))
    cfg = dict(meta["model_config"])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    if merged:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        state = merged_state_dict(ckpt)
    elif (ckpt / "dcp" / ".metadata").exists():
        model = AutoModelForCausalLM.from_config(config)
        state = _dcp_state_dict(ckpt, model)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        state = checkpoint_state_dict(ckpt)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()  # tied heads are stored once
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise PretrainerError(f"{ckpt}: weights missing for {missing[:5]}")
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(ckpt / "tokenizer").save_pretrained(out)
    write_provenance(out, {**provenance(meta, ckpt), "merged": merged})
    return out


def save_final(accelerator, model, tokenizer, out: Path, record: dict) -> Path:
    """`out/` (the run's `final/`): save_pretrained model (safetensors) + tokenizer, loadable by
    AutoModelForCausalLM; ZeRO-3 / FSDP shards are gathered onto the main process. `record`: its provenance (the
    run id, step and tokens), in `provenance.json`."""
    accelerator.wait_for_everyone()
    state = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(
        out, state_dict=state, is_main_process=accelerator.is_main_process, save_function=accelerator.save
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(out)
        write_provenance(out, record)
    accelerator.wait_for_everyone()
    return out
