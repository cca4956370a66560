"""The private third-party APIs (and undocumented formats) we rely on, in one list. An upgrade that removes or
renames one fails here, naming it, instead of somewhere deep in a training run. Each entry says where we use it and
why no public API does the job; when a public one appears, use it and delete the entry."""

import importlib

import pytest
import torch

PRIVATE = [
    # (module, attribute path, used in, why)
    ("torch", "_foreach_norm", "checkpoint/integrity.py",
     "one fused max-abs per dtype group for the live NaN/Inf check (torch has no public foreach norm)"),
    ("torch", "_foreach_lerp_", "train/averaging.py",
     "the EMA update over every tensor of the rank's share in one kernel launch (with _foreach_mul_/_add_/copy_/"
     "zero_; torch has no public foreach API; optimizers use the same)"),
    ("torch", "_foreach_copy_", "train/averaging.py", "the merged weights swapped into the live tensors and back"),
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset", "train/averaging.py",
     "where this rank's FSDP2 shard starts in the full parameter, to store the average as flat pieces"),
    ("torch.distributed._state_dict_utils", "_copy_state_dict", "checkpoint/dcp.py",
     "copy FSDP2 shards into pinned host buffers reused between async saves (DCP's own staging helper)"),
    ("torch.distributed._state_dict_utils", "_create_cpu_state_dict", "checkpoint/dcp.py",
     "allocate those pinned buffers once, shaped like the shards"),
    ("deepspeed.runtime.config", "DeepSpeedConfig", "checkpoint/loading.py",
     "`engine._config.load_universal_checkpoint` switched on for one load (a universal checkpoint on a new world "
     "size); DeepSpeed reads it only from the config object"),
    ("liger_kernel.transformers", "_apply_liger_kernel_to_instance", "model/build.py",
     "patch an already-built model in place (the public entry points patch classes before building)"),
    ("lm_eval.api.model", "tqdm", "evaluation/downstream.py",
     "lm-eval's progress bars silenced for the duration of a scoring (its modules import `tqdm` by name)"),
    ("lm_eval.api.task", "tqdm", "evaluation/downstream.py", "as above"),
    ("lm_eval.models.huggingface", "tqdm", "evaluation/downstream.py", "as above"),
    ("transformers.masking_utils", "find_packed_sequence_indices", "model/masking.py",
     "skip the per-forward packed-sequence check (a host sync per micro batch) for rows without position ids; "
     "transformers has no switch for it outside torch.compile"),
    ("wandb.proto.wandb_internal_pb2", "Record", "observe/wandb_history.py",
     "read an offline W&B run's history (the `.wandb` file format is undocumented) to backfill a resumed run"),
]  # fmt: skip


@pytest.mark.parametrize("module,attr,where,why", PRIVATE, ids=[f"{m}.{a}" for m, a, _, _ in PRIVATE])
def test_private_api_still_exists(module, attr, where, why):
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        if module.split(".")[0] in ("liger_kernel",):
            pytest.skip(f"{module} is an optional extra not installed here ({e})")
        raise
    assert hasattr(mod, attr), f"{module}.{attr} is gone (used in {where}: {why})"


def test_attn_implementation_and_torch_load_swap():
    """Two private attributes of objects rather than modules: transformers' `config._attn_implementation` (which
    attention the model really runs, model/masking.py), and `torch.load` swapped for a weights-only loader while
    DeepSpeed reads a checkpoint (checkpoint/safe_load.py; DeepSpeed calls `torch.load` itself)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(attn_implementation="sdpa")
    assert cfg._attn_implementation == "sdpa"
    from pretrainer.checkpoint.safe_load import weights_only

    real = torch.load
    with weights_only("x"):
        assert torch.load is not real
    assert torch.load is real
