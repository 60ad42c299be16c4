"""The KT engine's model runner: one forward pass over every token of the step, whatever sequence it
belongs to. Linears, norms and the experts see one flat [tokens, hidden] batch (so the CPU experts run once
per layer per step for the whole batch); only attention looks at sequence boundaries, through the spans."""
from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn

from engines.base import EngineUnavailableError
from engines.kt.experts.cpuinfer import WorkerIsolation
from engines.kt.families.deepseek_mla.kv_cache import BlockTable, LatentKVCache
from engines.kt.families.deepseek_mla.attention import DecodeBatch, MLAAttention, Span, StepBatch
from engines.kt.families.deepseek_mla.graphs import DecodeGraphs
from engines.kt.layers import device_scope
from engines.kt.experts import deferral as expert_deferral
from engines.kt.drafting import DraftHead, Drafter
from engines.kt.experts.deferral import ExpertDeferral
from engines.kt.experts.protocol import RoutedExperts
from engines.kt.step_timing import StepTimer
from engines.lora.install import LoraModules
from engines.lora.modules import AdapterRows
from engines.runtime.batch_invariance import scores_are_invariant
from engines.runtime.model_runner import ModelRunner, ScheduledChunk
from engines.runtime.sequence import Sequence

log = logging.getLogger("ktserve.engine.kt")


def graph_max_batch(max_batch: int, streams_from: int) -> int:
    """The largest decode batch to capture in a CUDA graph (0: none). A step of `streams_from` sequences or more
    (kt_gpu_prefill_tokens; 0: off) streams part of its experts to the GPU, which a replayed graph, captured with
    the experts on the CPU, would not: those steps run eagerly."""
    if streams_from and streams_from <= max_batch:
        return streams_from - 1
    return max_batch


class KTModelRunner(ModelRunner):
    def __init__(self, model: nn.Module, layer_devices: list[torch.device], cache: LatentKVCache,
                 max_model_len: int, flash: Any = None, draft_head: DraftHead | None = None,
                 draft_unavailable: str | None = None):
        self.model = model
        self.flash = flash  # engines.kt.families.deepseek_mla.flashinfer.FlashInferMLA when FlashInfer attends; None: torch
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.layer_devices = layer_devices
        self.cache = cache
        self.max_model_len = max_model_len
        for i, layer in enumerate(self.layers):
            if not isinstance(layer.self_attn, MLAAttention):
                raise ValueError(f"placement rules: model.layers.{i}.self_attn must be replaced by "
                                 f"engines.kt.placement.operators.MLAAttention (found "
                                 f"{type(layer.self_attn).__name__})")
        self._experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
        self._streamers = list({id(e.streamer): e.streamer for e in self._experts if e.streamer is not None}.values())
        # decode steps run each layer's deferred experts into the next layer's (n_deferred_experts), through the
        # state the model's layers share (OperatorOptions.deferral)
        self.deferring = expert_deferral.link(self._experts)
        self.deferral = self.deferring[0].deferral if self.deferring else ExpertDeferral()
        self.defer_max_batch = min((expert_deferral.max_batch(e.num_experts, e.top_k, e.deferred)
                                    for e in self.deferring), default=0)
        self.embed_device = self.inner.embed_tokens.weight.device
        self.norm_device = self.inner.norm.weight.device
        self.head_device = model.lm_head.weight.device
        # Split over several devices (a multi-GPU rule file), each layer runs with its GPU as the current
        # device, so whatever is launched on "the current device" (kt-kernel's stream callbacks included)
        # goes to the layer's own GPU.
        self.devices = set(layer_devices) | {self.embed_device, self.norm_device, self.head_device}
        self._scope = device_scope if len(self.devices) > 1 else (lambda device: contextlib.nullcontext())
        self.lora = LoraModules(model, model.config.hidden_size)
        # one cache slot no sequence owns: padded rows of a fixed-shape decode step write there
        self._scratch = BlockTable()
        cache.admit(self._scratch, [0], "", reuse=False)
        self.scratch_slot = int(cache.slots(self._scratch, 0, 1)[0])
        # keeps the other threads off kt-kernel's worker cores once applied (engine.py); undone in close()
        self.isolation = WorkerIsolation()
        self.graphs = None  # DecodeGraphs, once captured
        self._replayed = False  # the last decode step was a graph replay
        self.timer = StepTimer(self._experts, next(iter(self.devices)) if len(self.devices) == 1
                               else torch.device("cpu"))
        # speculative decoding: the family's draft head, fed the final hidden states of every step
        self.drafter = Drafter(draft_head, self) if draft_head is not None else None
        self.drafts = self.drafter is not None
        if any(d.type == "cuda" for d in layer_devices):
            # on a GPU a step drafts for one decoding sequence at most: on an H200, batches of three drafting
            # sequences left the replies the same batch gets without drafting (eager and from CUDA graphs, not on
            # every run) while single sequences matched in every run; not yet explained
            # (docs/serving.md: speculative decoding)
            self.draft_max_batch = 1
        self.draft_unavailable = draft_unavailable

    def capture_decode_graphs(self, max_batch: int) -> None:
        """Capture the decode step in CUDA graphs (one GPU, no hot experts on it); see cuda_graphs.py.

        A placement over several devices decodes without graphs (logged once): the step's hops between
        GPUs would have to be captured across devices, which is not done here."""
        if len(self.devices) != 1 or next(iter(self.devices)).type != "cuda":
            where = ", ".join(sorted(str(d) for d in self.devices))
            log.info("kt_use_cuda_graph: decode runs without CUDA graphs, because the non-expert model is "
                     "not on one GPU (it runs on %s); graphs are captured for a single-GPU placement only", where)
            return
        if any(e.gpu_experts for e in self._experts):
            log.info("kt_use_cuda_graph: decode runs without CUDA graphs, because the rules keep hot experts on "
                     "the GPU (gpu_experts), whose torch part is not captured")
            return
        if any(getattr(e, "method", None) == "LLAMAFILE" for e in self._experts):
            log.info("kt_use_cuda_graph: decode runs without CUDA graphs, because the experts run as LLAMAFILE (a "
                     "GGUF's blocks), whose calls wait on the host for their routing instead of queuing on the stream")
            return
        streams_from = self.stream_tokens()
        largest = graph_max_batch(max_batch, streams_from)
        if largest == 0:
            log.info("kt_use_cuda_graph: decode runs without CUDA graphs, because kt_gpu_prefill_tokens=1 "
                     "streams part of every step's experts to the GPU")
            return
        if largest < max_batch:
            log.info("kt_use_cuda_graph: decode steps of %d sequences or more run without CUDA graphs: they stream "
                     "part of their routed experts to the GPU (kt_gpu_prefill_tokens, or kt_gpu_read_experts past the "
                     "calls its kernels take)", streams_from)
            max_batch = largest
        self.graphs = DecodeGraphs(self._decode_forward, device=self.embed_device, max_batch=max_batch,
                                   max_len=self.max_model_len, scratch_slot=self.scratch_slot, cache=self.cache,
                                   attention=self.flash)
        # a graph defers or not by its padded batch size; eager steps follow the same limit, so a step's
        # arithmetic does not depend on whether a graph served it
        if self.deferring:
            self.defer_max_batch = max(b for b in self.graphs.batch_sizes if b <= self.defer_max_batch)
        with torch.inference_mode(), torch.cuda.device(self.embed_device):  # the model's GPU need not be cuda:0
            try:
                self.graphs.capture()
            except RuntimeError as exc:
                if not self.timer.cuda:
                    raise
                self.timer.stop_gpu_timing(f"capturing the decode graphs with timing events failed ({exc})")
                self.graphs.graphs.clear()
                self.graphs.capture()

    # ------------------------------------------------------------------------ cache bookkeeping
    @staticmethod
    def _table(seq: Sequence) -> BlockTable:
        if seq.runner_state is None:
            seq.runner_state = BlockTable()
        return seq.runner_state  # type: ignore[return-value]

    def admit(self, seq: Sequence) -> int | None:
        # prompt logprobs need logits at every prompt position, so those prompts are computed whole
        # the growth margin is for sequences already running: one alone may fill the whole cache
        margin = self.cache.growth_margin if self.kv_usage()[0] else 0
        return self.cache.admit(self._table(seq), seq.token_ids, self.lora.prefix_key(seq.request.adapter),
                                reuse=seq.prompt_logprobs is None, margin=margin)

    def grow(self, seq: Sequence, num_positions: int) -> bool:
        return self.cache.grow(self._table(seq), num_positions)

    def prefix_in_flight(self, seq: Sequence, prefilling: list[Sequence]) -> bool:
        if seq.prompt_logprobs is not None:  # computed whole, whatever is cached
            return False
        root = self.lora.prefix_key(seq.request.adapter)
        leaders = [(self._table(s), s.token_ids, s.num_computed) for s in prefilling  # their tokens: the prompt
                   if self.lora.prefix_key(s.request.adapter) == root]
        return self.cache.in_flight(self._table(seq), seq.token_ids, root, leaders)

    def release(self, seq: Sequence) -> None:
        if self.drafter is not None:
            self.drafter.forget(seq)
        if seq.runner_state is not None:
            self.cache.release(seq.runner_state)  # type: ignore[arg-type]
            seq.runner_state = None

    def kv_usage(self) -> tuple[int, int]:
        scratch = self.cache.block_size  # the scratch block is the runner's own, never a request's
        return self.cache.used_tokens - scratch, self.cache.capacity_tokens - scratch

    def step_times(self) -> dict[str, float]:
        t = self.timer.totals
        return {"expert_wait": t.expert_wait, "expert": t.expert, "gpu": t.gpu}

    def stream_tokens(self) -> int:
        """The fewest tokens of an expert call that streams experts to the GPU (kt_gpu_prefill_tokens); 0: none."""
        return min((e.stream_tokens for e in self._experts if e.streamer is not None), default=0)

    def streamed_experts(self) -> tuple[int, int]:
        return sum(s.stats.chunks for s in self._streamers), sum(s.stats.bytes for s in self._streamers)

    # ------------------------------------------------------------------------ the step
    def execute(self, chunks: list[ScheduledChunk]) -> list[torch.Tensor | None]:
        self.timer.begin()
        self._replayed = False
        try:
            out = self._execute(chunks)
        except BaseException:
            # a step that failed between an expert layer's submit and wait leaves that call pending; the engine
            # retries the step's chunks, which must find every layer idle (the rest of a step is stateless: KV
            # rows are rewritten whole, pages are offered only after a step succeeds)
            for experts in self._experts:
                experts.abandon()
            raise
        self.timer.end(self._replayed)
        return out

    def _execute(self, chunks: list[ScheduledChunk]) -> list[torch.Tensor | None]:
        if all(c.num_tokens == 1 and c.samples and not c.all_logits and c.seq.request.adapter is None
               for c in chunks):
            logits = self._decode(chunks)
        else:
            pieces = []
            for chunk in chunks:
                table, end = self._table(chunk.seq), chunk.end + len(chunk.draft)
                self.cache.ensure(table, end)
                tokens = chunk.seq.token_ids + list(chunk.draft) if chunk.draft else chunk.seq.token_ids
                pieces.append((table, tokens, chunk.start, end, chunk.seq.request.adapter))
            spans, hidden = self._forward(pieces)
            logits = self._logits(chunks, spans, hidden)
            if self.drafter is not None:
                normed = self._final_norm(hidden)
                for chunk, span in zip(chunks, spans):
                    self.drafter.keep(chunk.seq, span.start, normed[span.row:span.row + span.n])
        # offered up to chunk.end: draft tokens' positions hold KV only once verification accepts them
        for chunk in chunks:  # their pages now hold the fed positions: full ones can serve later requests
            self.cache.offer(self._table(chunk.seq), chunk.seq.token_ids, chunk.end,
                             self.lora.prefix_key(chunk.seq.request.adapter))
        return logits

    def step_batch(self, pieces: list[tuple]) -> StepBatch:
        """The attention metadata of a step over (block table, start, end, adapter) pieces, in row order."""
        spans, positions = [], []
        row = 0
        for table, start, end, adapter in pieces:
            spans.append(Span(row=row, n=end - start, start=start, write_slots=self.cache.slots(table, start, end),
                              read_slots=self.cache.slots(table, 0, end), adapter=adapter,
                              blocks=table.blocks[:self.cache.blocks_for(end)]))
            positions.append(torch.arange(start, end))
            row += end - start
        return StepBatch(spans=spans, positions=torch.cat(positions), cache=self.cache,
                         rotary=self.inner.rotary_emb, flash=self.flash)

    def _forward(self, pieces: list[tuple]) -> tuple[list[Span], torch.Tensor]:
        """One forward over (block table, token ids, start, end, adapter) pieces; the last hidden states."""
        batch = self.step_batch([(table, start, end, adapter) for table, _, start, end, adapter in pieces])
        ids = [t for _, tokens, start, end, _ in pieces for t in tokens[start:end]]
        spans = batch.spans
        rows = AdapterRows([(s.adapter, s.row, s.n) for s in spans])
        with self.lora.context.step(rows):
            hidden = self.inner.embed_tokens(torch.tensor(ids, device=self.embed_device))
            for layer, device in zip(self.layers, self.layer_devices):
                hidden = hidden.to(device)
                with self._scope(device):
                    residual = hidden
                    hidden = residual + layer.self_attn(layer.input_layernorm(hidden), batch)
                    residual = hidden
                    hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        return spans, hidden

    def _decode(self, chunks: list[ScheduledChunk]) -> list[torch.Tensor | None]:
        """Every sequence decodes one token: one fixed-shape step, replayed from a CUDA graph when one fits. A
        drafted sequence's draft tokens are rows of their own, each attending up to its position (attention
        writes every row's KV before it reads), so verifying a draft is a decode step of more rows."""
        ids, positions, write, lengths, pages, first = [], [], [], [], [], []
        for chunk in chunks:
            table = self._table(chunk.seq)
            self.cache.ensure(table, chunk.end + len(chunk.draft))
            first.append(len(ids))
            for i, token in enumerate((chunk.seq.token_ids[chunk.start], *chunk.draft)):
                position = chunk.start + i
                ids.append(token)
                positions.append(position)
                write.append(self.cache.slot(table, position))
                lengths.append(position + 1)
                pages.append(table.blocks[:self.cache.blocks_for(position + 1)])
        if self.graphs is not None and self.graphs.fits(len(ids), max(lengths)):
            logits, hidden = self.graphs.run(ids, positions, write, lengths, pages)
            self._replayed = True
        else:
            logits, hidden = self._decode_eager(ids, positions, write, lengths, pages)
        rows = [slice(r, r + 1 + len(chunk.draft)) for r, chunk in zip(first, chunks)]
        if self.drafter is not None:
            for chunk, r in zip(chunks, rows):
                self.drafter.keep(chunk.seq, chunk.start, hidden[r])
        return [logits[r] for r in rows]

    def _decode_eager(self, ids: list[int], positions: list[int], write: list[int], lengths: list[int],
                      pages: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        n, device = len(ids), self.embed_device
        paged = None
        if self.flash is not None:  # FlashInfer reads the pages itself: no context to gather
            paged = {d: self.flash.eager(d).plan([1] * n, lengths, pages, causal=False)
                     for d in set(self.layer_devices)}
            read, mask = torch.full((n, 1), self.scratch_slot), torch.ones(n, 1, dtype=torch.bool)
        else:
            read, mask = self.cache.context_slots(pages, lengths, n, max(lengths), self.scratch_slot)
        with self.lora.context.step(AdapterRows([(None, i, 1) for i in range(n)])):
            logits, hidden = self._decode_forward(torch.tensor(ids, device=device),
                                                  torch.tensor(positions, device=device),
                                                  torch.tensor(write, device=device), read.to(device), mask.to(device),
                                                  paged)
            return logits.float(), hidden

    def _decode_forward(self, ids: torch.Tensor, positions: torch.Tensor, write: torch.Tensor,
                        read: torch.Tensor, mask: torch.Tensor, paged: dict | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step on fixed-shape tensors (capturable): logits [B, vocab] in the model's dtype, and the
        final (normed) hidden states [B, hidden] a draft head takes in.
        `paged`: each device's planned FlashInfer wrapper, when FlashInfer attends (read and mask unused)."""
        def step_batch(device: torch.device) -> DecodeBatch:
            return DecodeBatch(positions=positions.to(device), write_slots=write.to(device),
                               read_slots=read.to(device), mask=mask.to(device), cache=self.cache,
                               rotary=self.inner.rotary_emb, paged=paged.get(device) if paged else None)

        hidden = self.inner.embed_tokens(ids)
        batch = step_batch(hidden.device)
        with self.deferral.decoding(defer=ids.shape[0] <= self.defer_max_batch):
            for layer, device in zip(self.layers, self.layer_devices):
                if hidden.device != device:
                    hidden = hidden.to(device)
                    batch = step_batch(device)
                with self._scope(device):
                    hidden = hidden + layer.self_attn.decode(layer.input_layernorm(hidden), batch)
                    hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        normed = self._final_norm(hidden)
        return self.model.lm_head(normed.to(self.head_device)), normed

    def _final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's final norm, on its own device (a rule may put it apart from the last layer)."""
        with self._scope(self.norm_device):
            return self.inner.norm(hidden.to(self.norm_device))

    def final_hidden_states(self, prompts: list[list[int]], adapter: str | None) -> list[torch.Tensor]:
        """The prompts in as few forwards as the free cache allows (borrowed blocks, freed at once); one prompt a
        forward where scores are batch-invariant (runtime/batch_invariance.py)."""
        states: list[torch.Tensor] = []
        together = len(prompts) if not scores_are_invariant(self.batch_invariance) else 1
        while len(states) < len(prompts):
            tables: list[BlockTable] = []
            try:
                for prompt in prompts[len(states):len(states) + together]:
                    table = BlockTable()
                    if self.cache.admit(table, prompt, "", reuse=False) is None:
                        break
                    tables.append(table)
                if not tables:
                    raise EngineUnavailableError("no KV cache room for this prompt now; retry later")
                batch = prompts[len(states):len(states) + len(tables)]
                spans, hidden = self._forward([(t, p, 0, len(p), adapter) for t, p in zip(tables, batch)])
                normed = self._final_norm(hidden).float().cpu()
                states += [normed[s.row:s.row + s.n] for s in spans]
            finally:
                for table in tables:
                    self.cache.release(table)
        return states

    def _logits(self, chunks: list[ScheduledChunk], spans: list[Span], hidden: torch.Tensor):
        wanted: list[torch.Tensor] = []
        shape: list[int] = []
        for chunk, span in zip(chunks, spans):
            if chunk.all_logits:
                wanted.append(torch.arange(span.row, span.row + span.n))
                shape.append(span.n)
            elif chunk.samples:  # the last position, and each draft token's
                rows = 1 + len(chunk.draft)
                wanted.append(torch.arange(span.row + span.n - rows, span.row + span.n))
                shape.append(rows)
            else:
                shape.append(0)
        out: list[torch.Tensor | None] = [None] * len(chunks)
        if not wanted:
            return out
        rows = torch.cat(wanted).to(hidden.device)
        normed = self._final_norm(hidden.index_select(0, rows)).to(self.head_device)
        logits = self.model.lm_head(normed).float()
        start = 0
        for i, n in enumerate(shape):
            if n:  # left on the device: the sampler and the prompt's logprobs reduce them there
                out[i] = logits[start:start + n]
                start += n
        return out

    # ------------------------------------------------------------------------ drafting
    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[list[int]]:
        if self.drafter is None:
            return super().propose(seqs, depths)
        return self.drafter.propose(seqs, depths)

    def draft_batch(self, pieces: list[tuple[Sequence, int, int]]) -> StepBatch:
        """The attention metadata of a draft head's step over (sequence, start, end) pieces (its pages taken)."""
        tables = []
        for seq, start, end in pieces:
            table = self._table(seq)
            self.cache.ensure(table, end)
            tables.append((table, start, end, None))
        return self.step_batch(tables)

    def gpu_bytes(self) -> int:
        head = getattr(self.drafter, "head", None)
        extra = sum(p.numel() * p.element_size() for p in head.parameters() if p.is_cuda) if head is not None else 0
        return super().gpu_bytes() + extra

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
        self.layers = []
        self.isolation.restore()

