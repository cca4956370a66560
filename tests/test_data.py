import numpy as np
import pytest
from conftest import write

from pretrainer.data.pipeline import SourceData, validation_batches
from pretrainer.data.readers import read_documents
from pretrainer.data.sources import resolve_files
from pretrainer.data.tokenizer import train_bpe
from pretrainer.data.tokens import TokenArrays, token_dtype, tokenize
from pretrainer.errors import DataError
from pretrainer.recipe.sections import SourceSection


def test_stdlib_source_reads_real_files():
    src = SourceSection(type="python_stdlib", include=["json/*.py"])
    files = resolve_files("s", src)
    assert any(f.name == "decoder.py" for f in files)
    docs = read_documents("s", src)
    assert len(docs) == len(files) and any("JSONDecoder" in d for d in docs)


def test_local_jsonl_and_text(tmp_path):
    write(tmp_path / "a.jsonl", '{"body": "hello world"}\n{"body": "second doc"}\n{"body": ""}\n')
    src = SourceSection(type="files", include=[str(tmp_path / "*.jsonl")], text_field="body")
    assert read_documents("j", src) == ["hello world", "second doc"]
    bad = SourceSection(type="files", include=[str(tmp_path / "*.jsonl")], text_field="text")
    with pytest.raises(DataError, match=r"data.sources.j.text_field: 'text' not in the rows"):
        read_documents("j", bad)


def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(DataError, match=r"data.sources.m.include: .* matches no files"):
        read_documents("m", SourceSection(type="files", include=[str(tmp_path / "none/*.txt")]))
    write(tmp_path / "empty.txt", "")
    with pytest.raises(DataError, match="data.sources.e"):
        read_documents("e", SourceSection(type="files", include=[str(tmp_path / "empty.txt")]))


def test_tokenize_eos_between_documents():
    docs = [f"def f{i}(x):\n    return x + {i}\n" for i in range(40)]
    tok = train_bpe(docs, vocab_size=300)
    arr = tokenize(docs, tok)
    assert arr.tokens.dtype == np.uint16 == token_dtype(len(tok))
    assert arr.n_docs == 40
    ends = arr.doc_offsets[1:] - 1
    assert (arr.tokens[ends] == tok.eos_token_id).all()
    assert tok.decode(arr.tokens[arr.doc_offsets[3] : arr.doc_offsets[4] - 1].tolist()) == docs[3]
    assert token_dtype(70_000) == np.uint32


def test_a_foreign_id_in_the_validation_batches_is_one_line():
    """The per-batch check covers the training batches; the validation batches are built once and checked then."""
    tokens = np.arange(64, dtype=np.uint16) % 100
    val = TokenArrays(tokens, np.array([0, 64]))
    sources = {"web": SourceData(train=None, val=val)}
    assert len(validation_batches(sources, ["web"], 16, 2, 4, vocab=100)["web"]) == 2
    tokens[37] = 100
    with pytest.raises(DataError, match=r"token id 100 at token 37 \(data.sources.web, validation\)"):
        validation_batches(sources, ["web"], 16, 2, 4, vocab=100)
