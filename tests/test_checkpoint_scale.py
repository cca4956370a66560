"""The parts of checkpointing that scale: per-rank shares of hashing and verification, the live finite check, and
the remote copy (file:// here, the same fsspec calls as s3:// or gs://)."""

import json

import pytest
import run_recipe
import torch
from conftest import FIXTURES, step_losses

from pretrainer.checkpoint import format as ck
from pretrainer.checkpoint import integrity
from pretrainer.observe.tracking import read_jsonl


def test_shares_split_every_file_once_and_keep_rank_files_with_their_rank():
    sizes = {f"pytorch_model/zero_pp_rank_{r}_mp_rank_00_optim_states.pt": 1000 for r in range(4)}
    sizes |= {f"random_states_{r}.pkl": 10 for r in range(4)}
    sizes |= {
        "pytorch_model/mp_rank_00_model_states.pt": 900,
        "meta.json": 5,
        "tokenizer/tokenizer.json": 300,
        "dcp/__2_0.distcp": 700,
        "dcp/.metadata": 50,
    }
    for world in (1, 2, 3, 4, 8):
        parts = integrity.shares(sizes, world)
        flat = [f for p in parts for f in p]
        assert sorted(flat) == sorted(sizes) and len(flat) == len(set(flat))  # each file exactly once
        assert parts == integrity.shares(dict(reversed(sizes.items())), world)  # the same on every rank
    parts = integrity.shares(sizes, 4)
    for r in range(4):
        assert f"pytorch_model/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" in parts[r]
        assert f"random_states_{r}.pkl" in parts[r]
    assert "dcp/__2_0.distcp" in parts[2]
    loads = [sum(sizes[f] for f in p) for p in integrity.shares(sizes, 4)]
    assert max(loads) - min(loads) <= 900  # the unnamed files go to the least-loaded rank
    assert integrity.owner_of("pytorch_model/mp_rank_00_model_states.pt") is None  # every rank reads it


def test_live_check_sees_one_nan_in_params_or_optimizer_state():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    assert integrity.state_finite(model, opt).item() == 1.0
    opt.state[model[1].weight]["exp_avg_sq"][3] = float("nan")
    assert integrity.state_finite(model, opt).item() == 0.0
    opt.state[model[1].weight]["exp_avg_sq"][3] = 0.0
    with torch.no_grad():
        model[0].weight[0, 0] = float("inf")
    assert integrity.state_finite(model, opt).item() == 0.0
    big = torch.nn.Linear(2, 2)
    with torch.no_grad():
        big.weight.fill_(3e38)  # finite, though its sum of squares would overflow
    assert integrity.state_finite(big, torch.optim.SGD(big.parameters())).item() == 1.0


def cli(out, cache_dir, *extra):
    return [
        str(FIXTURES / "micro.yaml"),
        "--output-dir",
        str(out),
        "--set",
        f"data.cache_dir={cache_dir}",
        "--set",
        "checkpoint.every_tokens=4096",
        "--set",
        "eval.every_steps=0",
        "--set",
        "stages.0.steps=20",
        *extra,
    ]


def run_id(out) -> str:
    return json.loads((out / "run.json").read_text())["run_id"]


def test_remote_copy_follows_retention_and_serves_a_replaced_node(tmp_path, cache_dir):
    bucket = tmp_path / "bucket" / "run"
    out = tmp_path / "node1" / "run"
    url = ["--set", f"checkpoint.remote=file://{bucket}", "--set", "checkpoint.keep_last=2"]
    assert run_recipe.main(cli(out, cache_dir, *url)) == 0
    rid = run_id(out)
    remote = bucket / rid  # the run's own directory there; the remote names the run of each directory name
    assert (bucket / "owner-run").read_text() == rid
    local = sorted(c.path.name for c in ck.list_checkpoints(out / "checkpoints"))
    assert sorted(p.name for p in remote.iterdir()) == local == ["step_00000016", "step_00000020"]
    ev = read_jsonl(out / "events.jsonl")
    pruned = [e["path"].rsplit("/", 1)[-1] for e in ev if e["event"] == "remote_prune"]
    assert pruned == ["step_00000004", "step_00000008", "step_00000012"]
    for d in remote.iterdir():  # the same files and hashes as the local checkpoint
        assert (
            json.loads((d / ck.MANIFEST).read_text())["files"]
            == json.loads((out / "checkpoints" / d.name / ck.MANIFEST).read_text())["files"]
        )
        assert ck.read_meta(d)["run_id"] == rid
    before = step_losses(out)
    (remote / "step_00000020" / ck.MANIFEST).unlink()  # its upload died before the manifest: never fetched
    node = tmp_path / "node2" / "run"  # the node is gone; its replacement runs the same command, directory empty
    assert run_recipe.main(cli(node, cache_dir, *url, "--resume", "auto")) == 0
    assert run_id(node) == rid  # it continues the remote's run
    ev = read_jsonl(node / "events.jsonl")
    fetched = [e for e in ev if e["event"] == "remote_fetch"]
    assert len(fetched) == 1 and fetched[0]["path"].endswith(f"{rid}/step_00000016")
    assert [e for e in ev if e["event"] == "resume"][-1]["step"] == 16
    assert [e["source"] for e in ev if e["event"] == "run_identity"] == ["remote"]
    after = step_losses(node)
    assert all(before[k] == after[k] for k in range(17, 21))  # exact resume from the fetched copy


def test_nothing_crosses_run_identities(tmp_path, cache_dir, capsys):
    """A directory reused with --overwrite and a remote shared with the old run: a replaced node continues the new
    run (not the old run's newer step), an old checkpoint named by path is refused in the new run's directory but
    starts a branch in a fresh one, and an export never lands on another run's."""
    import export_checkpoint
    from test_hardening import one_line_error

    bucket, out = tmp_path / "bucket", tmp_path / "run"
    url = ["--set", f"checkpoint.remote=file://{bucket}"]
    assert run_recipe.main(cli(out, cache_dir, *url)) == 0
    old = run_id(out)
    assert run_recipe.main(cli(out, cache_dir, *url, "--overwrite", "--set", "stages.0.steps=12")) == 0
    new = run_id(out)
    assert new != old and (bucket / "owner-run").read_text() == new
    assert (bucket / old / "step_00000020").is_dir()  # the old run's copies are neither pruned nor overwritten
    assert json.loads((out / "final" / "provenance.json").read_text())["run_id"] == new
    node = tmp_path / "node2" / "run"  # a replaced node: the same --output-dir, empty
    assert run_recipe.main(cli(node, cache_dir, *url, "--resume", "auto", "--set", "stages.0.steps=12")) == 0
    ev = read_jsonl(node / "events.jsonl")
    assert [e["path"] for e in ev if e["event"] == "remote_fetch"][0].endswith(f"{new}/step_00000012")
    assert [e["step"] for e in ev if e["event"] == "resume"] == [12] and run_id(node) == new
    capsys.readouterr()
    foreign = str(bucket / old / "step_00000016")
    assert run_recipe.main(cli(out, cache_dir, *url, "--resume", foreign)) == 2
    assert f"a checkpoint of run {old}, not of this run ({new})" in one_line_error(capsys)
    branch = tmp_path / "branch"
    for _ in range(2):  # the branch command, repeated, resumes the same checkpoint again
        assert run_recipe.main(cli(branch, cache_dir, *url, "--resume", foreign)) == 0
        assert json.loads((branch / "run.json").read_text())["parent"] == old
    assert (bucket / "owner-run").read_text() == new  # the branch claimed its own directory name, not the run's
    assert (bucket / "owner-branch").read_text() == run_id(branch)
    assert export_checkpoint.main([foreign, str(out / "final")]) == 2
    assert f"holds a model exported from run {new}, and this checkpoint is of run {old}" in one_line_error(capsys)


def test_remote_copy_with_a_corrupt_newest_falls_back(tmp_path, cache_dir):
    from pretrainer.checkpoint.remote import fetch_newest, upload

    out = tmp_path / "run"
    assert run_recipe.main(cli(out, cache_dir, "--set", "stages.0.steps=8")) == 0
    remote = tmp_path / "remote"
    for c in ck.list_checkpoints(out / "checkpoints"):
        upload(c.path, f"file://{remote}")
    shard = remote / "step_00000008" / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])

    class Log:
        def __init__(self):
            self.events = []

        def event(self, kind, step, **kw):
            self.events.append((kind, kw))

    log, node = Log(), tmp_path / "node2"
    node.mkdir()
    assert fetch_newest(f"file://{remote}", node, log) == "step_00000004"
    assert log.events[0][0] == "remote_skip" and "truncated" in log.events[0][1]["reason"]
    assert ck.verify(node / "step_00000004") == [] and not list(node.glob(f"{ck.TMP_PREFIX}*"))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_verify_shares_find_a_corrupt_file_whoever_owns_it(tmp_path, cache_dir, world):
    out = tmp_path / "run"
    assert run_recipe.main(cli(out, cache_dir, "--set", "stages.0.steps=4")) == 0
    d = ck.list_checkpoints(out / "checkpoints")[-1].path
    f = d / "optimizer.bin"
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0xFF
    f.write_bytes(bytes(b))
    found = [ck.verify(d, share=(r, world)) for r in range(world)]
    assert sum(bool(p) for p in found) == 1  # exactly the owner's share sees it, and the union says so
    assert any("optimizer.bin: xxh3_128 mismatch" in x for p in found for x in p)


def test_a_background_save_checks_its_snapshot_for_nan(tmp_path, cache_dir):
    """One process, `checkpoint.async`: the NaN/Inf check runs on the host copy in the writer thread, not on the
    loop; a NaN put into the Adam moments after step 16's update is in step 16's checkpoint's record, and the NaN
    loss that follows rolls back past it."""
    out = tmp_path / "run"
    sets = ["--set", "checkpoint.async=true", "--set", "debug.inject.nan_state_step=16"]
    assert run_recipe.main(cli(out, cache_dir, *sets)) == 0
    ev = read_jsonl(out / "events.jsonl")
    saves = [(e["step"], e["state_finite"]) for e in ev if e["event"] == "checkpoint"]
    assert saves[:4] == [(4, True), (8, True), (12, True), (16, False)], saves
    rollbacks = [e for e in ev if e["event"] == "rollback"]
    assert rollbacks and rollbacks[0]["to_step"] == 12
    assert all(ck.verify(c.path) == [] for c in ck.list_checkpoints(out / "checkpoints"))
