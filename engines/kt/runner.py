"""The KT engine's model runner: one forward pass over every token of the step, whatever sequence it
belongs to. Linears, norms and the experts see one flat [tokens, hidden] batch (so the CPU experts run once
per layer per step for the whole batch); only attention looks at sequence boundaries, through the spans."""
from __future__ import annotations

import torch
from torch import nn

from engines.kt.kv_cache import BlockTable, LatentKVCache
from engines.kt.attention import DecodeBatch, MLAAttention, Span, StepBatch
from engines.kt.operators import MoEWithCPUExperts, RoutedExpertsCPU
from engines.kt.step_timing import StepTimer
from engines.lora.install import LoraModules
from engines.lora.modules import AdapterRows
from engines.runtime.model_runner import ModelRunner, ScheduledChunk
from engines.runtime.sequence import Sequence


class KTModelRunner(ModelRunner):
    def __init__(self, model: nn.Module, layer_devices: list[torch.device], cache: LatentKVCache,
                 max_model_len: int):
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.layer_devices = layer_devices
        self.cache = cache
        self.max_model_len = max_model_len
        for i, layer in enumerate(self.layers):
            if not isinstance(layer.self_attn, MLAAttention):
                raise ValueError(f"placement rules: model.layers.{i}.self_attn must be replaced by "
                                 f"engines.kt.operators.MLAAttention (found {type(layer.self_attn).__name__})")
        self._experts = [m for m in model.modules() if isinstance(m, RoutedExpertsCPU)]
        self.embed_device = self.inner.embed_tokens.weight.device
        self.head_device = model.lm_head.weight.device
        self.lora = LoraModules(model, model.config.hidden_size)
        # one cache slot no sequence owns: padded rows of a fixed-shape decode step write there
        self._scratch = BlockTable()
        cache.reserve(self._scratch, 1)
        cache.ensure(self._scratch, 1)
        self.scratch_slot = int(cache.slots(self._scratch, 0, 1)[0])
        self.graphs = None  # DecodeGraphs, once captured
        self._replayed = False  # the last decode step was a graph replay
        devices = set(layer_devices) | {self.embed_device, self.head_device}
        self.timer = StepTimer(self._experts, next(iter(devices)) if len(devices) == 1 else torch.device("cpu"))

    def capture_decode_graphs(self, max_batch: int) -> None:
        """Capture the decode step in CUDA graphs (one GPU, no hot experts on it); see cuda_graphs.py."""
        from engines.kt.cuda_graphs import DecodeGraphs

        devices = set(self.layer_devices) | {self.embed_device, self.head_device}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError("kt_use_cuda_graph needs the whole non-expert model on one GPU")
        if any(e.gpu_experts for e in self._experts):
            raise ValueError("kt_use_cuda_graph cannot be combined with hot experts on the GPU (gpu_experts)")
        self.graphs = DecodeGraphs(self._decode_forward, device=self.embed_device, max_batch=max_batch,
                                   max_len=self.max_model_len, scratch_slot=self.scratch_slot)
        with torch.inference_mode():
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

    def admit(self, seq: Sequence, max_positions: int) -> bool:
        return self.cache.reserve(self._table(seq), min(max_positions, self.max_model_len))

    def release(self, seq: Sequence) -> None:
        if seq.runner_state is not None:
            self.cache.release(seq.runner_state)  # type: ignore[arg-type]
            seq.runner_state = None

    def kv_usage(self) -> tuple[int, int]:
        scratch = self.cache.block_size  # the scratch block is the runner's own, never a request's
        return self.cache.used_tokens - scratch, self.cache.capacity_tokens - scratch

    def step_times(self) -> dict[str, float]:
        t = self.timer.totals
        return {"expert_wait": t.expert_wait, "expert": t.expert, "gpu": t.gpu}

    # ------------------------------------------------------------------------ the step
    def execute(self, chunks: list[ScheduledChunk]) -> list[torch.Tensor | None]:
        self.timer.begin()
        self._replayed = False
        out = self._execute(chunks)
        self.timer.end(self._replayed)
        return out

    def _execute(self, chunks: list[ScheduledChunk]) -> list[torch.Tensor | None]:
        if all(c.num_tokens == 1 and c.samples and not c.all_logits and c.seq.request.adapter is None
               for c in chunks):
            return self._decode(chunks)
        pieces = []
        for chunk in chunks:
            table = self._table(chunk.seq)
            self.cache.ensure(table, chunk.end)
            pieces.append((table, chunk.seq.token_ids, chunk.start, chunk.end, chunk.seq.request.adapter))
        spans, hidden = self._forward(pieces)
        return self._logits(chunks, spans, hidden)

    def _forward(self, pieces: list[tuple]) -> tuple[list[Span], torch.Tensor]:
        """One forward over (block table, token ids, start, end, adapter) pieces; the last hidden states."""
        spans, ids, positions = [], [], []
        row = 0
        for table, tokens, start, end, adapter in pieces:
            spans.append(Span(row=row, n=end - start, start=start, write_slots=self.cache.slots(table, start, end),
                              read_slots=self.cache.slots(table, 0, end), adapter=adapter))
            ids.extend(tokens[start:end])
            positions.append(torch.arange(start, end))
            row += end - start
        batch = StepBatch(spans=spans, positions=torch.cat(positions), cache=self.cache,
                          rotary=self.inner.rotary_emb)
        rows = AdapterRows([(s.adapter, s.row, s.n) for s in spans])
        with self.lora.context.step(rows):
            hidden = self.inner.embed_tokens(torch.tensor(ids, device=self.embed_device))
            for layer, device in zip(self.layers, self.layer_devices):
                hidden = hidden.to(device)
                residual = hidden
                hidden = residual + layer.self_attn(layer.input_layernorm(hidden), batch)
                residual = hidden
                hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        return spans, hidden

    def _decode(self, chunks: list[ScheduledChunk]) -> list[torch.Tensor | None]:
        """Every sequence decodes one token: one fixed-shape step, replayed from a CUDA graph when one fits."""
        ids, positions, write, read = [], [], [], []
        for chunk in chunks:
            table = self._table(chunk.seq)
            self.cache.ensure(table, chunk.end)
            ids.append(chunk.seq.token_ids[chunk.start])
            positions.append(chunk.start)
            write.append(int(self.cache.slots(table, chunk.start, chunk.end)[0]))
            read.append(self.cache.slots(table, 0, chunk.end))
        longest = max(len(r) for r in read)
        if self.graphs is not None and self.graphs.fits(len(ids), longest):
            logits = self.graphs.run(ids, positions, write, read)
            self._replayed = True
        else:
            read_rows = torch.full((len(ids), longest), self.scratch_slot, dtype=torch.long)
            mask = torch.zeros(len(ids), longest, dtype=torch.bool)
            for i, slots in enumerate(read):
                read_rows[i, :len(slots)] = slots
                mask[i, :len(slots)] = True
            device = self.embed_device
            with self.lora.context.step(AdapterRows([(None, i, 1) for i in range(len(ids))])):
                logits = self._decode_forward(torch.tensor(ids, device=device), torch.tensor(positions, device=device),
                                              torch.tensor(write, device=device), read_rows.to(device),
                                              mask.to(device)).float().cpu()
        return [logits[i:i + 1] for i in range(len(chunks))]

    def _decode_forward(self, ids: torch.Tensor, positions: torch.Tensor, write: torch.Tensor,
                        read: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The decode step on fixed-shape tensors (capturable): logits [B, vocab] in the model's dtype."""
        batch = DecodeBatch(positions=positions, write_slots=write, read_slots=read, mask=mask, cache=self.cache,
                            rotary=self.inner.rotary_emb)
        hidden = self.inner.embed_tokens(ids)
        for layer, device in zip(self.layers, self.layer_devices):
            if hidden.device != device:
                hidden = hidden.to(device)
                batch = DecodeBatch(positions=positions.to(device), write_slots=write.to(device),
                                    read_slots=read.to(device), mask=mask.to(device), cache=self.cache,
                                    rotary=self.inner.rotary_emb)
            hidden = hidden + layer.self_attn.decode(layer.input_layernorm(hidden), batch)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.lm_head(self.inner.norm(hidden.to(self.head_device)))

    def last_hidden_states(self, prompts: list[list[int]], adapter: str | None) -> torch.Tensor:
        """Each prompt in its own forward over borrowed cache blocks, freed at once."""
        from engines.base import EngineUnavailableError

        rows = []
        for prompt in prompts:
            table = BlockTable()
            if not self.cache.reserve(table, len(prompt)):
                raise EngineUnavailableError("no KV cache room to score this prompt now; retry later")
            try:
                self.cache.ensure(table, len(prompt))
                _, hidden = self._forward([(table, prompt, 0, len(prompt), adapter)])
                rows.append(self.inner.norm(hidden[-1:].to(self.head_device))[0].float().cpu())
            finally:
                self.cache.release(table)
        return torch.stack(rows)

    def _logits(self, chunks: list[ScheduledChunk], spans: list[Span], hidden: torch.Tensor):
        wanted: list[torch.Tensor] = []
        shape: list[int] = []
        for chunk, span in zip(chunks, spans):
            if chunk.all_logits:
                wanted.append(torch.arange(span.row, span.row + span.n))
                shape.append(span.n)
            elif chunk.samples:
                wanted.append(torch.tensor([span.row + span.n - 1]))
                shape.append(1)
            else:
                shape.append(0)
        out: list[torch.Tensor | None] = [None] * len(chunks)
        if not wanted:
            return out
        rows = torch.cat(wanted).to(hidden.device)
        normed = self.inner.norm(hidden.index_select(0, rows).to(self.head_device))
        logits = self.model.lm_head(normed).float().cpu()
        start = 0
        for i, n in enumerate(shape):
            if n:
                out[i] = logits[start:start + n]
                start += n
        return out

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
        self.layers = []


def layer_devices(model: nn.Module) -> list[torch.device]:
    """Where each decoder layer computes: the device of its attention's output projection."""
    return [layer.self_attn.o_proj.weight.device for layer in model.model.layers]


def uses_cpu_experts(model: nn.Module) -> bool:
    return any(isinstance(m, (RoutedExpertsCPU, MoEWithCPUExperts)) for m in model.modules())
