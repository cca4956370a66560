"""Publishing an exported model to the Hugging Face Hub, with a model card written from the run that trained it.

The card is the run's own account: the recipe (model, stages, schedule, optimizer), the tokens seen, the final
`val/ref`, the lm-eval scores where the run measured them, and its incidents (spikes, rollbacks, data skipped,
updates skipped), each read from the run directory, none typed by hand. The upload goes through
`huggingface_hub.HfApi` (`create_repo`, then `upload_folder`): the token is the library's (`HF_TOKEN` or
`huggingface-cli login`), and nothing is sent unless asked.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from ..analysis.report import report
from ..analysis.runfiles import load_run
from ..checkpoint.identity import PROVENANCE
from ..errors import PretrainerError, first_line
from ..observe import events as ev
from ..observe.tracking import RunLog
from ..recipe.sections import PublishSection

CARD = "README.md"


def run_dir_of(model_dir: Path) -> Path | None:
    """The run directory a model came from: a checkpoint's (`RUN/checkpoints/step_N`) or `RUN/final`'s, found
    through its provenance; None when it is not on this machine."""
    record = json.loads((model_dir / PROVENANCE).read_text()) if (model_dir / PROVENANCE).exists() else {}
    origin = Path(record.get("from") or "")
    for candidate in (origin.parent.parent, model_dir.parent):  # RUN/checkpoints/step_N, RUN/final
        if (candidate / "events.jsonl").exists() and (candidate / "recipe.resolved.yaml").exists():
            return candidate
    return None


def model_card(model_dir: str | Path, repo_id: str, run_dir: str | Path | None = None) -> str:
    """The card (README.md with its metadata block) for `model_dir`, from the run that trained it."""
    from huggingface_hub import ModelCard, ModelCardData

    model_dir = Path(model_dir)
    record = json.loads((model_dir / PROVENANCE).read_text()) if (model_dir / PROVENANCE).exists() else {}
    run = Path(run_dir) if run_dir else run_dir_of(model_dir)
    data = ModelCardData(library_name="transformers", pipeline_tag="text-generation", tags=["pretrainer"])
    lines = [f"# {repo_id.split('/')[-1]}", ""]
    config = json.loads((model_dir / "config.json").read_text()) if (model_dir / "config.json").exists() else {}
    arch = ", ".join(config.get("architectures") or [config.get("model_type", "?")])
    lines.append(
        f"A causal language model ({arch}: {config.get('num_hidden_layers', '?')} layers, hidden size "
        f"{config.get('hidden_size', '?')}, vocabulary {config.get('vocab_size', '?')}) pretrained with "
        "pretrainer: step {step:,}, {tokens:,} tokens{merged}.".format(
            step=record.get("step") or 0,
            tokens=record.get("tokens") or 0,
            merged=" (the averaged weights)" if record.get("merged") else "",
        )
    )
    if run is not None:
        lines += _from_run(run, record.get("step"))
    lines += ["", "## Provenance", "", f"run id `{record.get('run_id')}`, exported from `{record.get('from')}`."]
    card = ModelCard.from_template(
        data, template_str="---\n{{ card_data }}\n---\n\n{{ body }}\n", body="\n".join(lines)
    )
    return str(card)


def _from_run(run: Path, step: int | None) -> list[str]:
    """The card's sections read from the run directory: recipe, results up to `step`, incidents."""
    recipe = yaml.safe_load((run / "recipe.resolved.yaml").read_text())
    r = report(run, verify_checkpoint=False)
    opt, sched = recipe.get("optimizer", {}), recipe.get("schedule", {})
    out = ["", "## Training", ""]
    out.append(
        f"Recipe `{recipe.get('run', {}).get('name')}`: {opt.get('type', 'adamw')} at LR {opt.get('lr')}, "
        f"{sched.get('type')} schedule (warmup {sched.get('warmup_steps')} steps), global batch "
        f"{recipe.get('batch', {}).get('global_batch_tokens'):,} tokens."
    )
    out += ["", "| stage | from step | seq_len | first loss | last loss | last val |", "|---|---|---|---|---|---|"]
    for st in r["stages"]:
        out.append(
            f"| {st['name']} | {st['start_step']:,} | {st.get('seq_len')} | {_num(st.get('loss_first'))} | "
            f"{_num(st.get('loss_last'))} | {_num(st.get('val_last'))} |"
        )
    out += ["", "## Results", ""]
    val = _val_ref_at(run, step)
    if val is not None:
        out.append(
            f"`val/ref` (held-out loss on the run's fixed validation batches) at step {val[0]:,}: {val[1]:.4f}."
        )
    for name, d in (r.get("downstream") or {}).items():
        out.append(f"- lm-eval `{name}`: {d['last']:.5g} at step {d['last_step']:,} ({d['first']:.5g} at the start)")
    out += ["", "## Incidents", ""]
    lad = r["ladder"]
    out.append(
        f"{r['incidents'].get('spike', 0)} loss spike(s), {lad['rollback']['rollbacks']} rollback(s) "
        f"({lad['rollback']['replayed_steps']:,} steps replayed), {lad['data_skip']['samples']:,} sample(s) skipped "
        f"for good, {lad['skip_step']['steps']} update(s) skipped in place; the run's verdict: {r['verdict']}."
    )
    return out


def _val_ref_at(run: Path, step: int | None) -> tuple[int, float] | None:
    pts = [(m["step"], m["val/ref"]) for m in load_run(run).evals if isinstance(m.get("val/ref"), int | float)]
    pts = [p for p in pts if step is None or p[0] <= step]
    return pts[-1] if pts else None


def _num(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, int | float) else "-"


def push_to_hub(model_dir: str | Path, repo_id: str, private: bool = True, run_dir: str | Path | None = None) -> str:
    """Write the card into `model_dir` and upload the folder to `repo_id` (created if missing); returns the commit
    URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError
    from huggingface_hub.utils import validate_repo_id

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        raise PretrainerError(f"{model_dir}: no config.json: export the checkpoint first")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise PretrainerError(
            f"--push-to-hub {repo_id!r}: not a Hub repo id (NAME or OWNER/NAME): {first_line(e)}"
        ) from None
    (model_dir / CARD).write_text(model_card(model_dir, repo_id, run_dir))
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(
            folder_path=str(model_dir), repo_id=repo_id, repo_type="model", commit_message="Upload from pretrainer"
        )
    except (HfHubHTTPError, HFValidationError, OSError, *_transport_errors()) as e:
        # a network failure is the HTTP client's own error, whichever client this huggingface_hub sends through
        raise PretrainerError(
            f"--push-to-hub {repo_id}: {first_line(e)} (the local export in {model_dir} is complete)"
        ) from None
    return str(getattr(info, "commit_url", info))


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP clients' own error bases (connection refused, DNS, timeouts), whichever are installed:
    huggingface_hub 2.x sends through `httpx2`, 1.x through `httpx`, older ones through `requests`."""
    import importlib

    out: list[type[BaseException]] = []
    for module, name in (("httpx2", "HTTPError"), ("httpx", "HTTPError"), ("requests", "RequestException")):
        try:
            out.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(out)


def publish_run(cfg: PublishSection, run_dir: Path, log: RunLog, step: int) -> None:
    """`publish.repo`: upload the run's `final/` (and `merged/`) with a model card, once the run has saved them (the
    main process, `run_recipe.py` through `Trainer.train(after=...)`). A failed upload is an event and a line, not a
    failed run: the model is saved, and `export_checkpoint.py --push-to-hub` retries."""
    if cfg.repo is None:
        return
    targets = [(run_dir / "final", cfg.repo)]
    if cfg.merged and (run_dir / "merged").is_dir():
        targets.append((run_dir / "merged", f"{cfg.repo}-merged"))
    for path, repo in targets:
        try:
            url = push_to_hub(path, repo, private=cfg.private, run_dir=run_dir)
        except PretrainerError as e:
            log.event(ev.PUBLISH_FAILED, step, repo=repo, path=str(path), error=str(e))
            print(f"warning: publish: {e}; {path} is saved", file=sys.stderr)
            continue
        log.event(ev.PUBLISHED, step, repo=repo, path=str(path), url=url)
        print(f"published: {path} -> {url}", flush=True)
