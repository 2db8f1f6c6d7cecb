"""Helpers shared by tests that run whole stacks of real processes."""

from __future__ import annotations

import asyncio
import functools
import os
from pathlib import Path

from pcpstack.cli.stack import LocalStack, StackOptions


class RunningStack:
    """A LocalStack started in its own event loop, usable from synchronous tests."""

    def __init__(self, options: StackOptions) -> None:
        self.loop = asyncio.new_event_loop()
        self.stack = LocalStack(options, progress=lambda message: None)

    def start(self) -> RunningStack:
        try:
            self.loop.run_until_complete(self.stack.start())
        except BaseException:
            self.stop()
            raise
        return self

    def run(self, coroutine):
        """Runs a coroutine on the stack's loop."""
        return self.loop.run_until_complete(coroutine)

    def stop(self) -> None:
        self.loop.run_until_complete(self.stack.stop())
        self.loop.close()

    @property
    def decode(self) -> str:
        return self.stack.decode_addresses[0]


def start_stack(tmp: Path, **options) -> RunningStack:
    options.setdefault("lease_s", 2.0)
    options.setdefault("gateway", False)
    return RunningStack(StackOptions(log_dir=str(tmp), **options)).start()


async def pinned_bytes(store_address: str) -> int:
    """The KV store's pinned bytes once releases in flight have landed (waits for 0 a bounded while)."""
    return await _settled(store_address, "pinned_bytes")


async def prefix_leases(store_address: str) -> int:
    """The KV store's prefix leases held once releases in flight have landed (waits for 0 a bounded while)."""
    return await _settled(store_address, "prefix_leases")


async def _settled(store_address: str, field: str) -> int:
    from pcpstack.kvstore.client import KvStoreClient

    async with KvStoreClient(store_address) as store:
        for _ in range(100):
            value = getattr(await store.stat(), field)
            if value == 0:
                return 0
            await asyncio.sleep(0.1)
        return value


def child_pids(pid: int) -> list[int]:
    """Direct children of a process, oldest first (by pid)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry))
    return sorted(children)


def small_hf_llama(
    folder: Path,
    *,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 8,
    layers: int = 1,
    context: int = 1024,
    **config_extras,
):
    """A random Llama (fixed seed) saved as an HF folder: transformers' own config and weights, at a size that
    loads in a moment; config_extras go to LlamaConfig as they are (rope_parameters, initializer_range).
    Returns the transformers model (eval mode) for reference logits."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=heads * head_dim,
        intermediate_size=192,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        **config_extras,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    return model


@functools.cache
def hf_smollm2():
    """The shipped SmolLM2 in HF transformers (float32, eval mode), loaded by transformers from the same GGUF
    the engine reads, once per test session: transformers parses a GGUF's metadata slowly (20-30 s here), and
    the engine and e2e tests share this one copy (no test changes it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pcpstack.engine.weights import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def hf_greedy(model):
    """greedy(prompt_ids, n) -> the n token ids a transformers model picks greedily (eos ignored)."""

    def greedy(prompt_ids: list[int], n: int) -> list[int]:
        return hf_generation(model, prompt_ids, n)[0]

    return greedy


def hf_generation(model, prompt_ids: list[int], n: int):
    """(tokens, logits): the n token ids one transformers generation picks greedily after prompt_ids (eos
    ignored) and the logits [n, vocab] each was picked from: one forward of the prompt, then one per token
    with the cache, as generate runs. A model with dynamic RoPE keeps the frequencies of the longest sequence
    it has seen across calls: pass a copy that has run nothing for a fresh generation's."""
    import torch

    # A plain loop: generate(min_new_tokens=n) would forbid EOS; ignore_eos only goes on past it.
    tokens: list[int] = []
    logits = []
    with torch.inference_mode():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(n):
            logits.append(out.logits[0, -1])
            tokens.append(int(logits[-1].argmax()))
            if len(tokens) < n:
                out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, torch.stack(logits)
