"""The C decode kernels: block matmuls equal the dense fp32 matmul of the dequantized GGUF weights, paged
decode attention equals PyTorch's attention, and decode through them matches Hugging Face transformers."""

import json

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bench.engine_weights import random_q6_k
from pcpstack.common import native
from pcpstack.engine import cpu_kernels, quant
from pcpstack.engine.model import Linear
from pcpstack.engine.weights import default_model_path, load_model
from tests.engine.conftest import hf_logits

pytestmark = pytest.mark.skipif(
    cpu_kernels.build_library() is None, reason="no C compiler: kernels not built"
)


@pytest.fixture(scope="module")
def gguf_tensors() -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(str(default_model_path())).tensors}


def _dense(tensor: gguf.ReaderTensor) -> torch.Tensor:
    return torch.from_numpy(
        np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    )


@pytest.mark.parametrize(
    ("name", "kind"),
    [("blk.3.ffn_down.weight", "q4_1"), ("blk.5.attn_q.weight", "q4_1"), ("token_embd.weight", "q8_0")],
)
# 35 rows: the 1,536-wide weight is dequantized once for all the row tiles, the last one short.
@pytest.mark.parametrize("rows", [1, 3, 8, 11, 16, 35])
def test_block_matmul_equals_dense_matmul_of_dequantized_weight(gguf_tensors, name, kind, rows):
    tensor = gguf_tensors[name]
    blocks = quant.from_gguf(tensor.data, tensor.tensor_type.name)
    dense = _dense(tensor)
    assert blocks is not None and blocks.kind == kind and blocks.shape == tuple(dense.shape)
    x = torch.randn(rows, dense.shape[1], generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(blocks.matmul(x), x @ dense.T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("blk.3.ffn_down.weight", "q4_1"),
        ("blk.5.attn_q.weight", "q4_1"),
        ("token_embd.weight", "q8_0"),
        ("random 40 x 2048", "q4_1"),
        ("random 30 x 2080", "q4_1"),
    ],
)
def test_block_matmul_gives_each_row_the_same_bits_in_any_batch(gguf_tensors, name, kind):
    """A row's result does not depend on the batch it is multiplied in: alone (the one-row tile), among a
    few (the several-row tiles), or in a panel of 16 rows and the rows after it (on AVX2, in rounds of 768
    elements: two whole ones over the 1,536-wide down projection, 768 + 768 + 512 over 2,048 columns; 2,080
    columns are too wide for the panels' weight buffer, so other tiles take the whole batch)."""
    if name.startswith("random"):
        rows, cols = (int(n) for n in name.split()[1::2])
        generator = torch.Generator().manual_seed(cols)
        qs = torch.randint(0, 256, (rows, cols // 32, 16), generator=generator).to(torch.uint8)
        scale = torch.rand(rows, cols // 32, generator=generator).half().float()
        minimum = -torch.rand(rows, cols // 32, generator=generator).half().float()
        blocks = quant.BlockWeight(kind, qs, scale, minimum)
    else:
        tensor = gguf_tensors[name]
        blocks = quant.from_gguf(tensor.data, tensor.tensor_type.name)
    if kind == "q8_0":  # the whole vocabulary is slow to multiply this often
        blocks = quant.BlockWeight(blocks.kind, blocks.qs[:600], blocks.scale[:600], None)
    x = torch.randn(35, blocks.shape[1], generator=torch.Generator().manual_seed(3))
    batch = blocks.matmul(x)
    for first, rows in ((0, 1), (5, 1), (7, 2), (16, 3), (0, 8), (3, 16), (16, 19)):
        part = blocks.matmul(x[first : first + rows])
        assert torch.equal(part, batch[first : first + rows]), (first, rows)


@pytest.fixture
def fresh_kernels(monkeypatch, tmp_path):
    """Kernels built and judged anew in an empty cache, with the module's caches restored afterwards."""
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    cpu_kernels.build_library.cache_clear()
    cpu_kernels.library.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    cpu_kernels.build_library.cache_clear()
    cpu_kernels.library.cache_clear()


@pytest.fixture(scope="module")
def haswell_kernels(tmp_path_factory):
    """The kernels built for haswell (AVX2 and FMA, 8-lane vectors: what an AVX2-only CPU compiles), once for
    the module; they run on this CPU too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path_factory.mktemp("haswell")))
        patch.setenv(cpu_kernels.ARCH_ENV, "haswell")
        cpu_kernels.build_library.cache_clear()
        try:
            lib = cpu_kernels.build_library()
        finally:
            cpu_kernels.build_library.cache_clear()
    assert lib is not None
    return lib


def _q6_k_case(rows: int, cols: int) -> tuple[quant.BlockWeight, torch.Tensor]:
    """Random Q6_K bytes (d as small as real files', so the weights are too) as blocks, and gguf's dense
    values of them."""
    raw = random_q6_k(np.random.default_rng(rows), rows, cols, (-1e-4, 1e-4))
    dense = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K))
    return quant.from_gguf(raw, "Q6_K"), dense


def test_kernels_built_for_avx2_only_cpus_equal_the_dense_matmul(gguf_tensors, haswell_kernels):
    """The AVX2 code must give the dense results for every block kind, on whole tiles and on the rows left
    over, with weight rows dequantized once for a batch's row tiles (576 wide; 1,536 wide from 16 rows, four
    4-row tiles, on) or in every tile (1,536 wide, fewer rows), and in panels of 16 input rows (16 and 19
    rows; 67 Q6_K weight rows end in a panel tile of one)."""
    lib = haswell_kernels
    gguf_names = ("blk.3.ffn_down.weight", "blk.5.attn_q.weight", "token_embd.weight")
    for name in (*gguf_names, "q6_k 512", "q6_k 1536"):
        if name.startswith("q6_k"):
            blocks, dense = _q6_k_case(67, int(name.split()[1]))
        else:
            tensor = gguf_tensors[name]
            blocks = quant.from_gguf(tensor.data, tensor.tensor_type.name)
            dense = _dense(tensor)
        if name == "token_embd.weight":  # the whole vocabulary is slow to compare densely
            dense = dense[:4096]
            blocks = quant.BlockWeight(blocks.kind, blocks.qs[:4096], blocks.scale[:4096], None)
        for rows in (1, 2, 3, 4, 7, 16, 19):
            x = torch.randn(rows, dense.shape[1], generator=torch.Generator().manual_seed(rows))
            out = cpu_kernels.block_matmul(lib, blocks.kind, x, blocks.qs, blocks.scale, blocks.minimum)
            torch.testing.assert_close(out, x @ dense.T, atol=1e-4, rtol=1e-5)


def _dequantized(blocks: quant.BlockWeight) -> torch.Tensor:
    """The [rows, cols] fp32 weight the blocks encode (scale * q is exact; adding min rounds once)."""
    if blocks.kind == "q8_0":
        values = blocks.qs.float() * blocks.scale[..., None]
    elif blocks.kind == "q6_k":  # a scale for each half block
        values = blocks.qs.float() * blocks.scale.view(*blocks.qs.shape[:2], 2).repeat_interleave(16, dim=-1)
    else:
        nibbles = torch.cat((blocks.qs & 0x0F, blocks.qs >> 4), dim=-1).float()
        values = nibbles * blocks.scale[..., None] + blocks.minimum[..., None]
    return values.reshape(blocks.qs.shape[0], -1)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q6_k"])
def test_block_matmul_of_one_hot_rows_returns_every_dequantized_weight_bit_for_bit(kind):
    """Every tile shape (the wide one of batch 1 and 2, the rows left after it, batch 3's, batches of several
    row tiles, whose weight rows are dequantized once for all of them, and on AVX2 the panels of 16 input
    rows, with 1 to 6 weight rows and the input rows after the last whole panel) reads each block with its
    own scale and min and looks up each nibble exactly: one-hot inputs give the weights back."""
    generator = torch.Generator().manual_seed(7)
    cols = 64
    for weight_rows in (1, 4, 11):
        width = 16 if kind == "q4_1" else 32
        qs = torch.randint(0, 256, (weight_rows, cols // 32, width), generator=generator)
        if kind == "q6_k":  # 6-bit q - 32
            qs = (qs // 4 - 32).to(torch.int8)
        else:
            qs = qs.to(torch.uint8) if kind == "q4_1" else (qs - 128).to(torch.int8)
        # fp16 values, as a GGUF file stores them (so that scale * q is exact in fp32); Q6_K's every 16.
        groups = cols // quant.SCALE_GROUP[kind]
        scale = torch.rand(weight_rows, groups, generator=generator).half().float()
        minimum = -torch.rand(weight_rows, cols // 32, generator=generator).half().float()
        minimum = minimum if kind == "q4_1" else None
        blocks = quant.BlockWeight(kind, qs, scale, minimum)
        expected = _dequantized(blocks)
        for batch in (1, 2, 3, 9, 16, 35):
            eye = torch.eye(cols)
            for first in range(0, cols, batch):
                x = eye[first : first + batch]
                assert torch.equal(blocks.matmul(x), expected[:, first : first + x.shape[0]].T)


def test_kernels_slower_than_plain_pytorch_are_not_used(fresh_kernels, monkeypatch, caplog):
    """The engine never takes a path slower than its fallback: kernels that do not beat the dense matmul by
    the margin asked for (here an impossible one) are left out with a log line, the verdict is kept beside
    the library, and PCPSTACK_CPU_KERNELS=1 uses them anyway."""
    monkeypatch.setenv(cpu_kernels.MIN_SPEEDUP_ENV, "1000")
    assert cpu_kernels.build_library() is not None
    assert cpu_kernels.library() is None
    assert "slower than plain PyTorch on this CPU" in caplog.text
    (verdict,) = fresh_kernels.glob("*.speed.json")
    kept = json.loads(verdict.read_text())
    assert kept["use"] is False and kept["min_speedup"] == 1000 and kept["kernel_us"] > 0
    monkeypatch.setenv(cpu_kernels.ENABLE_ENV, "1")
    cpu_kernels.library.cache_clear()
    assert cpu_kernels.library() is cpu_kernels.build_library()


def test_a_first_build_keeps_the_faster_of_two_tunings_for_every_later_process(fresh_kernels):
    """Both tunings are built and timed once and the faster one is loaded; the choice kept beside the
    libraries is what a later process loads, without timing them again."""
    lib = cpu_kernels.build_library()
    compiler = native.compiler()
    (choice,) = fresh_kernels.glob("*.tuning.json")
    kept = json.loads(choice.read_text())
    assert set(kept["micros"]) == set(cpu_kernels.TUNINGS) and min(kept["micros"].values()) > 0
    assert kept["micros"][kept["tuning"]] == min(kept["micros"].values())
    assert lib._pcpstack_path == cpu_kernels._library_path(compiler, kept["tuning"])
    # A later process finds the other tuning kept (as another machine's timing might have chosen): it loads
    # that library and leaves the choice as it was.
    other = next(t for t in cpu_kernels.TUNINGS if t != kept["tuning"])
    choice.write_text(json.dumps({"tuning": other, "micros": kept["micros"]}))
    cpu_kernels.build_library.cache_clear()
    assert cpu_kernels.build_library()._pcpstack_path == cpu_kernels._library_path(compiler, other)
    assert json.loads(choice.read_text())["tuning"] == other


def test_block_matmul_refuses_input_of_the_wrong_width(gguf_tensors):
    tensor = gguf_tensors["blk.0.ffn_down.weight"]
    blocks = quant.from_gguf(tensor.data, tensor.tensor_type.name)
    with pytest.raises(ValueError, match="expected \\[m, 1536\\]"):
        blocks.matmul(torch.zeros(2, 576))


def test_formats_without_kernels_keep_no_blocks(gguf_tensors):
    norm = gguf_tensors["blk.0.attn_norm.weight"]
    assert quant.from_gguf(norm.data, norm.tensor_type.name) is None


def test_every_projection_of_the_loaded_model_has_blocks_equal_to_its_dense_weight(smollm):
    """Fusing (q|k|v, gate|up) and undoing the q/k row permutation must treat blocks like the dense rows."""
    linears = [m for m in smollm.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * smollm.args.n_layers
    x = torch.randn(2, smollm.args.hidden_dim, generator=torch.Generator().manual_seed(0))
    for module in [*linears, None]:
        blocks = smollm.model.output_blocks if module is None else module.blocks
        assert blocks is not None
        # Blocks are the loaded model's only copy; test_quant_weights.py checks them against gguf's dense.
        weight = blocks.dequantize()
        cols = x[:, : weight.shape[1]].contiguous()
        torch.testing.assert_close(blocks.matmul(cols), F.linear(cols, weight), atol=1e-4, rtol=1e-5)


def _paged_case(
    seed: int, context_lens: list[int], block_size: int = 16, heads: int = 9, kv_heads: int = 3, dim: int = 64
):
    generator = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in context_lens)
    num_blocks = width * len(context_lens) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator)
    # Each sequence owns a scattered set of blocks, as after many allocations and frees.
    tables = torch.randperm(num_blocks, generator=generator)[: width * len(context_lens)].view(
        len(context_lens), width
    )
    q = torch.randn(len(context_lens), heads, dim, generator=generator)
    return q, k_cache, v_cache, tables, torch.tensor(context_lens)


def _assert_paged_attention_equals_sdpa(lib, q, k_cache, v_cache, tables, lens) -> None:
    out = cpu_kernels.paged_decode_attention(lib, q, k_cache, v_cache, tables, lens)
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    for s, n in enumerate(lens.tolist()):
        keys = k_cache[tables[s]].flatten(0, 1)[:n].repeat_interleave(heads // kv_heads, dim=1)
        values = v_cache[tables[s]].flatten(0, 1)[:n].repeat_interleave(heads // kv_heads, dim=1)
        ref = F.scaled_dot_product_attention(q[s][:, None], keys.transpose(0, 1), values.transpose(0, 1))
        torch.testing.assert_close(out[s], ref[:, 0], atol=1e-5, rtol=1e-5)


def test_paged_decode_attention_equals_sdpa_over_each_sequences_blocks():
    case = _paged_case(0, [1, 15, 16, 17, 200, 513])
    _assert_paged_attention_equals_sdpa(cpu_kernels.build_library(), *case)


@pytest.mark.parametrize("arch", ["native", "haswell"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size", "context_lens"),
    [
        # A 128-wide head; blocks of 5 tokens, so key tiles straddle blocks; lengths 1 to 2,048.
        (8, 2, 128, 5, [1, 2, 31, 2048]),
        # One sequence: its context split into parts of whole blocks, combined after.
        (12, 3, 64, 16, [333]),
        # A head of 40 floats: whole 8-lane vectors on AVX2, the plain loops on AVX-512; no grouping.
        (6, 6, 40, 7, [1, 9, 100]),
    ],
)
def test_paged_decode_attention_equals_sdpa_for_other_head_layouts(
    arch, heads, kv_heads, dim, block_size, context_lens, haswell_kernels
):
    lib = haswell_kernels if arch == "haswell" else cpu_kernels.build_library()
    case = _paged_case(3, context_lens, block_size, heads, kv_heads, dim)
    _assert_paged_attention_equals_sdpa(lib, *case)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("block_size", "context_lens"),
    [
        # Fewer sequences than twice the threads: each context is cut into parts of whole blocks; a context
        # of one token or one block leaves some parts empty; 5-token blocks end a part inside a key tile.
        (16, [1]),
        (16, [20]),
        (16, [333]),
        (5, [97, 1, 240]),
    ],
)
def test_paged_decode_attention_of_few_sequences_combines_the_parts_of_each_context(
    threads, block_size, context_lens
):
    case = _paged_case(5, context_lens, block_size)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _assert_paged_attention_equals_sdpa(cpu_kernels.build_library(), *case)
    finally:
        torch.set_num_threads(before)


def test_paged_decode_attention_refuses_a_table_outside_the_cache():
    q, k_cache, v_cache, tables, lens = _paged_case(1, [20, 30])
    lib = cpu_kernels.build_library()
    with pytest.raises(ValueError, match="outside the cache"):
        cpu_kernels.paged_decode_attention(lib, q, k_cache, v_cache, tables + k_cache.shape[0], lens)
    with pytest.raises(ValueError, match="outside the cache"):
        cpu_kernels.paged_decode_attention(lib, q, k_cache, v_cache, tables, lens + 10_000)


# Decode batches of sequences of different lengths: nine (more rows than one matmul tile holds), and nineteen
# (on AVX2, a panel of 16 rows and three rows after it).
NINE = (1, 17, 40, 2, 5, 9, 12, 3, 7)
NINETEEN = (*NINE, 4, 30, 6, 11, 8, 21, 14, 10, 2, 16)


@pytest.mark.parametrize("lengths", [NINE, NINETEEN], ids=["nine", "nineteen"])
def test_fused_decode_layers_equal_the_layer_modules(smollm, smollm_engine, lengths):
    """Batched decode through the fused C layers gives the logits of the same steps through the PyTorch
    modules (which call the block matmuls and the attention kernel one by one), for sequences of different
    lengths: nine of them (more rows than one matmul tile holds), and nineteen (on AVX2, a panel of 16 rows
    through the fused layers' own panel buffers, and three rows after it); later steps read the K/V rows the
    fused layers wrote."""
    generator = torch.Generator().manual_seed(2)
    vocab = smollm.args.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
    kernels = [layer.decode_kernel for layer in smollm.model.layers]
    assert all(k is not None for k in kernels)
    whole_step = smollm.model.decode_kernel

    def decode(fused: bool) -> torch.Tensor:
        # unfused: neither the layers' kernels nor the whole-step call made of them
        smollm.model.decode_kernel = whole_step if fused else None
        for layer, kernel in zip(smollm.model.layers, kernels, strict=True):
            layer.decode_kernel = kernel if fused else None
        seqs = [("fused", fused, i) for i in range(len(prompts))]
        try:
            tokens = [int(smollm_engine.prefill(s, p).argmax()) for s, p in zip(seqs, prompts, strict=True)]
            steps = []
            for _ in range(2):
                steps.append(smollm_engine.decode_step(seqs, tokens))
                tokens = steps[-1].argmax(-1).tolist()
            return torch.stack(steps)
        finally:
            for s in seqs:
                smollm_engine.free(s)
            smollm.model.decode_kernel = whole_step
            for layer, kernel in zip(smollm.model.layers, kernels, strict=True):
                layer.decode_kernel = kernel

    torch.testing.assert_close(decode(True), decode(False), atol=1e-4, rtol=0)


@pytest.mark.parametrize("lengths", [(530,), NINE, NINETEEN], ids=["one", "nine", "nineteen"])
def test_fused_decode_step_equals_the_fused_layers_and_logits_projection(smollm, smollm_engine, lengths):
    """The whole step as one C call (layers, final norm, logits) computes what the layer kernels called one by
    one, the norm module and the logits block matmul compute, and picks the same tokens: one stream at a long
    context, and nine and nineteen of them."""
    model = smollm.model
    assert model.decode_kernel is not None
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, smollm.args.vocab_size, (n,), generator=generator).tolist() for n in lengths]

    def decode(whole: bool) -> torch.Tensor:
        kernel, model.decode_kernel = model.decode_kernel, model.decode_kernel if whole else None
        seqs = [("whole", whole, i) for i in range(len(prompts))]
        try:
            tokens = [int(smollm_engine.prefill(s, p).argmax()) for s, p in zip(seqs, prompts, strict=True)]
            steps = []
            for _ in range(3):
                steps.append(smollm_engine.decode_step(seqs, tokens))
                tokens = steps[-1].argmax(-1).tolist()
            return torch.stack(steps)
        finally:
            model.decode_kernel = kernel
            for s in seqs:
                smollm_engine.free(s)

    # The layers run the same code either way; only the final norm sums its squares in another order.
    whole, by_layer = decode(True), decode(False)
    torch.testing.assert_close(whole, by_layer, atol=1e-4, rtol=0)
    assert torch.equal(whole.argmax(-1), by_layer.argmax(-1))


def test_fused_decode_step_refuses_a_slot_outside_the_cache(smollm):
    args = smollm.args
    cache = torch.zeros(args.n_layers, 2, 2, 16, args.n_kv_heads, args.head_dim)
    x, cos, sin = torch.zeros(1, args.dim), torch.ones(1, args.head_dim), torch.zeros(1, args.head_dim)
    tables, lens = torch.tensor([[0]]), torch.tensor([1])
    with pytest.raises(ValueError, match="outside the cache"):
        smollm.model.decode_kernel(x, cos, sin, cache, torch.tensor([32]), tables, lens)
    assert not cache.any()  # refused before writing anything


def test_fused_decode_step_refuses_layers_of_different_shapes(smollm):
    model = smollm.model
    layers = [layer.decode_kernel for layer in model.layers]
    narrow = quant.DecodeLayerKernel(cpu_kernels.DecodeLayerWeightsC(), ())  # a layer of shape 0
    for chosen in ([], [layers[0], narrow]):
        with pytest.raises(ValueError, match="all of one shape"):
            quant.DecodeModelKernel.build(chosen, model.norm.weight, model.norm.eps, model.output_blocks)


def test_fused_decode_layer_refuses_a_slot_outside_the_cache(smollm):
    layer = smollm.model.layers[0]
    kv_heads, head_dim = smollm.args.n_kv_heads, smollm.args.head_dim
    caches = (torch.zeros(2, 16, kv_heads, head_dim), torch.zeros(2, 16, kv_heads, head_dim))
    x, cos, sin = torch.zeros(1, smollm.args.dim), torch.ones(1, head_dim), torch.zeros(1, head_dim)
    tables, lens = torch.tensor([[0]]), torch.tensor([1])
    with pytest.raises(ValueError, match="outside the cache"):
        layer.decode_kernel(x, cos, sin, caches, torch.tensor([32]), tables, lens)
    assert not caches[0].any() and not caches[1].any()  # refused before writing anything


@pytest.mark.slow
def test_decode_steps_on_the_kernels_match_hf_logits(smollm, smollm_engine, hf_model):
    ids = smollm.tokenizer.encode(
        "Paged attention keeps each sequence's keys and values in fixed-size blocks, so a decode step reads "
        "them where they lie. The three primary colours are red, green and"
    )
    reference = hf_logits(hf_model, ids)
    steps, prompt = 8, ids[:-8]
    logits = [smollm_engine.prefill("kernels", prompt)]
    try:
        for token in ids[len(prompt) : len(prompt) + steps - 1]:
            logits.append(smollm_engine.decode_step(["kernels"], [token])[0])
    finally:
        smollm_engine.free("kernels")
    expected = reference[len(prompt) - 1 : len(prompt) - 1 + steps]
    torch.testing.assert_close(torch.stack(logits), expected, atol=1e-4, rtol=0)


def test_kernels_switched_off_leave_the_model_on_dense_weights(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENABLE_ENV, "0")
    cpu_kernels.build_library.cache_clear()
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is None
        loaded = load_model(None, device="cpu", dtype=torch.float32)
        assert loaded.model.output_blocks is None
        assert all(m.blocks is None for m in loaded.model.modules() if isinstance(m, Linear))
    finally:
        monkeypatch.undo()
        cpu_kernels.build_library.cache_clear()
        cpu_kernels.library.cache_clear()


def test_a_compiler_that_fails_means_no_kernels_not_a_crash(monkeypatch, tmp_path, caplog):
    compiler = tmp_path / "cc"
    compiler.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && echo fake-cc 1.0 && exit 0\necho "cc: boom" >&2\nexit 1\n'
    )
    compiler.chmod(0o755)
    cache = tmp_path / "cache"
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(cache))
    cpu_kernels.build_library.cache_clear()
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is None
        assert "plain PyTorch" in caplog.text and "cc: boom" in caplog.text
        assert list(cache.iterdir()) == []  # nothing half-built left behind
    finally:
        monkeypatch.undo()
        cpu_kernels.build_library.cache_clear()
        cpu_kernels.library.cache_clear()
