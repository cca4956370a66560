"""Document masking: each packed document trains exactly as if it were fed alone, under every attention path that
runs on a CPU; and the trainer runs with it."""

import pytest
import run_recipe
import torch
import torch.nn.functional as F
from conftest import FIXTURES, tiny_llama

from pretrainer.model.masking import document_inputs, plain_inputs
from pretrainer.observe.tracking import read_jsonl

EOS = 0


def model(impl: str):
    return tiny_llama(kv_heads=4, tie=False, max_position_embeddings=64, attn_implementation=impl).eval()


def doc_losses(m, x: dict, bounds: list[tuple[int, int]]) -> list[float]:
    """Mean next-token loss of each document [a, b) of row 0, from packed inputs."""
    labels = x.pop("labels")
    with torch.no_grad():
        logits = m(**x).logits.float()
    tok = F.cross_entropy(logits[0, :-1], labels[0, 1:], reduction="none", ignore_index=-100)
    return [tok[a : b - 1].mean().item() for a, b in bounds]  # targets a+1 .. b-1 belong to document [a, b)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_documents_lose_exactly_what_they_lose_alone(impl):
    g = torch.Generator().manual_seed(1)
    docs = [torch.cat([torch.randint(1, 64, (n,), generator=g), torch.tensor([EOS])]) for n in (5, 11, 3, 12)]
    row = torch.cat(docs)[None]  # 35 tokens, 4 documents
    bounds, a = [], 0
    for d in docs:
        bounds.append((a, a + len(d)))
        a += len(d)
    m = model(impl)
    with torch.no_grad():
        alone = [m(input_ids=d[None], labels=d[None]).loss.item() for d in docs]
    packed = doc_losses(m, document_inputs(row, EOS, impl), bounds)
    assert max(abs(p - q) for p, q in zip(packed, alone)) <= 1e-5
    unmasked = doc_losses(m, plain_inputs(row), bounds)
    assert max(abs(p - q) for p, q in zip(unmasked[1:], alone[1:])) > 1e-3  # without it, documents see each other
    x = document_inputs(row, EOS, impl)
    assert x["position_ids"][0].tolist()[:8] == [0, 1, 2, 3, 4, 5, 0, 1]
    assert (x["labels"][0] == -100).sum().item() == 4  # no document's first token is a target


def test_flash_attention_gets_positions_and_no_mask():
    x = document_inputs(torch.tensor([[3, 4, EOS, 5, EOS, 6]]), EOS, "flash_attention_2")
    assert "attention_mask" not in x and x["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0]]


def test_trainer_runs_with_document_masking(tmp_path, cache_dir):
    out = tmp_path / "run"
    argv = [
        str(FIXTURES / "micro.yaml"),
        "--output-dir",
        str(out),
        "--set",
        f"data.cache_dir={cache_dir}",
        "--set",
        "data.document_masking=true",
        "--set",
        "stages.0.steps=20",
    ]
    assert run_recipe.main(argv) == 0
    val = [m["val/avg"] for m in read_jsonl(out / "metrics.jsonl") if "val/avg" in m]
    assert val[-1] < val[0] - 0.3
