"""A single-process runner: owns the model, the paged KV cache and its allocator, and offers prefill (one-shot
or chunked), batched decode steps over a changing set of sequences, KV replica adoption and a generate
loop."""

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pcpstack.engine.attention import AttentionMetadata, KvExchange
from pcpstack.engine.dcp import DcpShard, DcpStep, KvPart
from pcpstack.engine.kv_cache import BlockAllocator, KvLayout, PagedKVCache, blocks_needed, slots_for
from pcpstack.engine.sampling import SamplingParams, StopChecker, TokenHistory, make_generator, sample
from pcpstack.engine.weights import LoadedModel, load_model

DEFAULT_BLOCK_SIZE = 16
DEFAULT_CACHE_TOKENS = 16384


@dataclass
class SequenceState:
    """A sequence's blocks and how many of its tokens have K/V in them."""

    block_table: list[int] = field(default_factory=list)
    num_tokens: int = 0


@dataclass
class GenerationResult:
    """What `Engine.generate` produced."""

    token_ids: list[int]
    text: str
    finish_reason: str


class Engine:
    """Model + paged KV cache + block allocator for many concurrent sequences, keyed by any hashable id.

    A decode context-parallel rank (`dcp` of size D > 1, built by the TP engine) stores only its own token
    blocks of each sequence (engine.dcp) and only decodes and adopts: `num_tokens` of a sequence stays its
    global length, the blocks and the replicas it adopts or exports are the rank's share.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
        dcp: DcpShard | None = None,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.args = loaded.args
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.layout = KvLayout.for_model(loaded.model_id, loaded.args, loaded.dtype, block_size)
        num_blocks = num_blocks or blocks_needed(DEFAULT_CACHE_TOKENS, block_size)
        self.cache = PagedKVCache(self.layout, num_blocks, self.device)
        self.allocator = BlockAllocator(num_blocks)
        self.sequences: dict[Hashable, SequenceState] = {}
        self.dcp = dcp or DcpShard(0, 1, block_size)
        if self.dcp.block_size != block_size:
            raise ValueError(f"DCP interleave size {self.dcp.block_size} must equal block_size={block_size}")

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **kwargs: int,
    ) -> "Engine":
        """Load a model (see `load_model`) and build an engine around it."""
        return cls(load_model(path, device, dtype), **kwargs)

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self.layout.block_size

    @property
    def dcp_size(self) -> int:
        """Ranks a sequence's tokens are split over (1: this engine holds them all)."""
        return self.dcp.size

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks this engine needs for a sequence of `num_tokens` tokens."""
        return self.dcp.blocks_for(num_tokens)

    def kv_parts(self, num_tokens: int) -> list[KvPart]:
        """Where a sequence's K/V lives: one part, every K/V head and every position."""
        return [KvPart(0, range(self.layout.num_kv_heads), self.dcp.owned_runs(num_tokens))]

    def reserve(self, seq_id: Hashable, total_tokens: int) -> SequenceState:
        """The sequence's state (created if new) with blocks for `total_tokens` tokens."""
        if total_tokens > self.args.max_seq_len:
            raise ValueError(
                f"sequence of {total_tokens} tokens exceeds the context length {self.args.max_seq_len}"
            )
        state = self.sequences.setdefault(seq_id, SequenceState())
        missing = self.blocks_for(total_tokens) - len(state.block_table)
        if missing > 0:
            state.block_table.extend(self.allocator.allocate(missing))
        return state

    def _tensor(self, values: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def prefill(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        chunk_size: int | None = None,
    ) -> torch.Tensor:
        """Append `token_ids` to a sequence (new or existing); return the logits [vocab] after the last one.

        With `chunk_size`, the tokens go through the model in chunks of at most that many, each attending to
        everything cached before it.
        """
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        start = self.sequences[seq_id].num_tokens if seq_id in self.sequences else 0
        state = self.reserve(seq_id, start + len(token_ids))
        chunk_size = chunk_size or len(token_ids)
        for offset in range(0, len(token_ids), chunk_size):
            chunk = token_ids[offset : offset + chunk_size]
            begin = start + offset
            # Every chunk rotates as the one forward over all the tokens would (dynamic RoPE).
            logits = self.forward_tokens(state, chunk, begin, rope_len=start + len(token_ids))
            state.num_tokens = begin + len(chunk)
        return logits[0]

    def forward_tokens(
        self,
        state: SequenceState,
        token_ids: Sequence[int],
        start: int,
        positions: torch.Tensor | None = None,
        kv_positions: torch.Tensor | None = None,
        kv_exchange: KvExchange | None = None,
        all_logits: bool = False,
        logits_rows: torch.Tensor | None = None,
        rope_len: int | None = None,
    ) -> torch.Tensor:
        """Run tokens of one sequence that sit at `positions` (default: consecutive from `start`); return the
        logits [1, vocab] of the last position (of every token, [n, vocab], with `all_logits`).

        Context-parallel prefill passes its local tokens' positions (possibly none), the `kv_positions` of the
        whole prompt that its `kv_exchange` returns, start=0, and the `logits_rows` it wants (possibly none).
        A chunk of a longer prompt passes `rope_len`, the sequence's length once the whole prompt is in
        (dynamic RoPE rotates by it; default: the length after these tokens). The caller updates
        `state.num_tokens`.
        """
        if self.dcp.size > 1:
            raise ValueError("a decode context-parallel rank holds part of each sequence: it only decodes")
        positions = positions if positions is not None else torch.arange(start, start + len(token_ids))
        positions = positions.to(self.device)
        kv_positions = kv_positions.to(self.device) if kv_positions is not None else positions
        context_len = max(start + len(token_ids), int(kv_positions.max()) + 1)
        table = self._tensor(state.block_table)
        meta = AttentionMetadata(
            positions=positions,
            slot_mapping=slots_for(table, kv_positions, self.block_size),
            block_tables=table[None],
            context_lens=self._tensor([context_len]),
            max_context_len=context_len,
            kv_exchange=kv_exchange,
            fresh_context=start == 0 and kv_positions.numel() == context_len,
            rope_lens=None if rope_len is None else self._tensor([rope_len]),
        )
        if logits_rows is not None:
            rows = logits_rows.to(self.device)
        else:
            rows = None if all_logits else self._tensor([int(positions.argmax())])
        return self.model(self._tensor(token_ids), positions, self.cache, meta, rows)

    @torch.inference_mode()
    def decode_step(
        self, seq_ids: Sequence[Hashable], token_ids: Sequence[int], *, logits: bool = True
    ) -> torch.Tensor:
        """Append one token to each sequence (each at its own length); return logits [len(seq_ids), vocab].
        With logits=False the step only extends the caches and returns [0, vocab]: a TP follower's logits
        would be thrown away, and the replicated LM head is the largest matrix of a small model."""
        if len(seq_ids) != len(token_ids):
            raise ValueError(f"decode_step got {len(seq_ids)} sequences but {len(token_ids)} tokens")
        states = [self.reserve(s, self.sequences[s].num_tokens + 1) for s in self._known(seq_ids)]
        positions = [s.num_tokens for s in states]
        logits_rows = None if logits else self._tensor([])
        if self.dcp.size > 1:
            return self._dcp_decode_step(states, positions, token_ids, logits_rows)
        slots = [
            s.block_table[p // self.block_size] * self.block_size + p % self.block_size
            for s, p in zip(states, positions, strict=True)
        ]
        width = max(len(s.block_table) for s in states)
        # Padding entries point at block 0; the context-length mask hides them.
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in states]
        meta = AttentionMetadata(
            positions=self._tensor(positions),
            slot_mapping=self._tensor(slots),
            block_tables=self._tensor(tables),
            context_lens=self._tensor([p + 1 for p in positions]),
            max_context_len=max(positions) + 1,
        )
        result = self.model(self._tensor(token_ids), meta.positions, self.cache, meta, logits_rows)
        for state in states:
            state.num_tokens += 1
        return result

    def _dcp_decode_step(
        self,
        states: list[SequenceState],
        positions: list[int],
        token_ids: Sequence[int],
        logits_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """decode_step on a DCP rank: local block tables and key counts; it writes only the new tokens whose
        block it owns."""
        dcp, size = self.dcp, self.block_size
        rows = [i for i, p in enumerate(positions) if dcp.owns(p)]
        slots = []
        for i in rows:
            local = dcp.local_index(positions[i])
            slots.append(states[i].block_table[local // size] * size + local % size)
        # At least one column: a rank may own no block yet of any sequence in the step.
        width = max(1, *(len(s.block_table) for s in states))
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in states]
        counts = [dcp.local_count(p + 1) for p in positions]
        meta = AttentionMetadata(
            positions=self._tensor(positions),
            slot_mapping=self._tensor(slots),
            block_tables=self._tensor(tables),
            context_lens=self._tensor(counts),
            max_context_len=max(counts),
            dcp=DcpStep(dcp, self._tensor(rows)),
            rope_lens=self._tensor([p + 1 for p in positions]),  # context_lens count local keys only
        )
        result = self.model(self._tensor(token_ids), meta.positions, self.cache, meta, logits_rows)
        for state in states:
            state.num_tokens += 1
        return result

    def _known(self, seq_ids: Sequence[Hashable]) -> Sequence[Hashable]:
        unknown = [s for s in seq_ids if s not in self.sequences]
        if unknown:
            raise KeyError(f"unknown sequences {unknown}: prefill or adopt them first")
        return seq_ids

    def adopt_sequence(
        self, seq_id: Hashable, kv: torch.Tensor | Sequence[torch.Tensor], num_tokens: int
    ) -> None:
        """Start `seq_id` from an imported KV replica [layers, 2, num_tokens, kv_heads, head_dim] (a DCP
        rank: its share, [layers, 2, dcp.local_count(num_tokens), kv_heads, head_dim]), or from the pieces
        of one along the tokens, in order (each written straight into the cache)."""
        if seq_id in self.sequences:
            raise ValueError(f"sequence {seq_id!r} already exists")
        pieces = [kv] if isinstance(kv, torch.Tensor) else list(kv)
        local = self.dcp.local_count(num_tokens)
        held = sum(piece.shape[2] for piece in pieces)
        if held != local:
            share = "" if self.dcp.size == 1 else f" (this DCP rank's share: {local})"
            raise ValueError(f"KV replica holds {held} tokens, not num_tokens={num_tokens}{share}")
        state = self.reserve(seq_id, num_tokens)
        try:
            at = 0
            for piece in pieces:
                self.cache.import_sequence(piece, state.block_table, start=at)
                at += piece.shape[2]
        except ValueError:
            self.free(seq_id)
            raise
        state.num_tokens = num_tokens

    def adopt_parts(self, seq_id: Hashable, parts: Sequence[torch.Tensor], num_tokens: int) -> None:
        """`adopt_sequence` from the one part `kv_parts` names (the TP engine's signature, so a caller can
        adopt the same way whatever engine it holds)."""
        if len(parts) != 1:
            raise ValueError(f"got {len(parts)} KV parts, this engine takes 1")
        self.adopt_sequence(seq_id, parts[0], num_tokens)

    def export_sequence(self, seq_id: Hashable) -> torch.Tensor:
        """The sequence's KV replica [layers, 2, num_tokens, kv_heads, head_dim] (a DCP rank: its share)."""
        state = self.sequences[seq_id]
        return self.cache.export_sequence(state.block_table, self.dcp.local_count(state.num_tokens))

    def export_pieces(self, seq_id: Hashable, start: int = 0) -> list[torch.Tensor]:
        """`export_sequence(seq_id)[:, :, start:]` as contiguous views of the cache, in its byte order
        (PagedKVCache.sequence_pieces); only while the sequence lives and takes no new tokens."""
        state = self.sequences[seq_id]
        return self.cache.sequence_pieces(state.block_table, self.dcp.local_count(state.num_tokens), start)

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks; unknown ids are ignored so cancellation can always call it."""
        state = self.sequences.pop(seq_id, None)
        if state is not None:
            self.allocator.free(state.block_table)

    def generate(self, token_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        """Prefill the prompt, then decode one token at a time until a stop condition; frees its KV after."""
        params.validate()
        seq_id = object()
        checker = StopChecker(params, self.args.eos_token_ids, self.tokenizer)
        generator = make_generator(params.seed)
        try:
            logits = self.prefill(seq_id, token_ids)
            while True:
                history = TokenHistory(token_ids, checker.token_ids, checker.stop_ids)
                token = sample(logits, params, generator, history)
                checker.push(token)
                if checker.finish_reason is not None:
                    return GenerationResult(checker.token_ids, checker.text, checker.finish_reason)
                logits = self.decode_step([seq_id], [token])[0]
        finally:
            self.free(seq_id)
