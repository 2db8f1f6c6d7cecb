"""engine.gguf_file reads exactly what gguf.GGUFReader reads (metadata values and types, tensor names,
types, shapes and bytes) from the embedded SmolLM2 GGUF, and refuses what it cannot read by name."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pcpstack.engine.gguf_file import read_gguf
from pcpstack.engine.parallel import TensorParallelShard
from pcpstack.engine.weights import _read_gguf, _read_gguf_shard, default_model_path, shard_state


def test_reads_what_gguf_reader_reads() -> None:
    path = default_model_path()
    fast, reference = read_gguf(path), gguf.GGUFReader(str(path))
    expected = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert fast.meta.keys() == expected.keys()
    for key, value in expected.items():
        assert fast.meta[key] == value and type(fast.meta[key]) is type(value), key
    assert len(expected["tokenizer.ggml.tokens"]) == 49152
    assert [t.name for t in fast.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(fast.tensors, reference.tensors, strict=True):
        assert (mine.tensor_type, mine.n_elements) == (theirs.tensor_type, theirs.n_elements), mine.name
        assert mine.shape == tuple(theirs.shape.tolist()), mine.name
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        assert np.array_equal(mine.data, theirs.data), mine.name


@pytest.mark.parametrize(
    ("content", "needle"),
    [(b"PK\x03\x04 not a model", "not a GGUF file"), (b"GGUF\x00\x00\x00\x01" + bytes(16), "GGUF version")],
)
def test_a_file_it_cannot_read_is_refused_naming_it(tmp_path, content, needle) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=needle) as refused:
        read_gguf(path)
    assert "model.gguf" in str(refused.value)


@pytest.mark.parametrize(("tp", "ranks"), [(3, (1,)), (9, (0, 4, 8))])
def test_a_tp_rank_reads_exactly_its_shard_of_the_whole_model(tp, ranks) -> None:
    # A TP rank dequantizes only its rows and columns; it must get what slicing the whole model gives,
    # bit for bit (TP=9 cuts SmolLM2's 1,536-wide MLP off the 32-value quantization blocks).
    path = default_model_path()
    args, whole, _, _ = _read_gguf(path, True)
    for rank in ranks:
        shard = TensorParallelShard(rank, tp)
        expected = shard_state(whole, args, shard)
        _, mine, _, _ = _read_gguf_shard(path, True, shard)
        assert mine.keys() == expected.keys()
        assert [k for k in expected if not torch.equal(mine[k], expected[k])] == []
