"""GET /metrics: Prometheus text format, one registry per app (several servers can share a process).

Request-side numbers come from each request's tracker when it ends; engine-side numbers (queue lengths,
KV cache, step time) are read from `engine.stats()` at scrape time, so they are never stale.

The share of step time the KT engine spends waiting on its CPU experts is
`rate(ktserve_engine_expert_wait_seconds_total[5m]) / rate(ktserve_engine_step_seconds_total[5m])`; the GPU's
share likewise from `ktserve_engine_gpu_seconds_total`, and the rest of the step (Python, sampling, delivery)
is step - gpu - expert_wait (of which step - forward is after the forward: sampling, detokenizing, delivery).
The prefix cache's hit rate is
`rate(ktserve_prefix_cache_hit_tokens_total[5m]) / rate(ktserve_prefix_cache_queried_tokens_total[5m])`, and with
speculative decoding the draft's acceptance rate over a window
`rate(ktserve_spec_decode_accepted_tokens_total[5m]) / rate(ktserve_spec_decode_draft_tokens_total[5m])`."""
from __future__ import annotations

from typing import Iterator

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engines.base import Engine
from server import __version__
from server.tracking import RequestTracker

# CPU-offloaded experts make prefill slow on big models: first tokens can take tens of seconds.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5)

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


class Metrics:
    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ktserve_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.latency = Histogram("ktserve_request_duration_seconds", "Seconds from arrival to the last byte",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("ktserve_time_to_first_token_seconds",
                              "Seconds from a request's arrival to the first token of each of its choices",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("ktserve_time_per_output_token_seconds",
                              "Mean seconds per token after the first, per choice", buckets=TPOT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("ktserve_prompt_tokens", "Prompt tokens of requests that were served",
                                     registry=r)
        self.generation_tokens = Counter("ktserve_generation_tokens", "Output tokens the model produced",
                                         registry=r)
        self.finished = Counter("ktserve_choices_finished", "Choices by how they ended: the engine's finish "
                                "reason, or request_timeout / client_disconnected / server_shutdown",
                                ["finish_reason"], registry=r)
        r.register(EngineCollector(engine))

    def observe(self, t: RequestTracker) -> None:
        self.requests.labels(t.route, str(t.status)).inc()
        self.latency.labels(t.route).observe(t.duration)
        if not t.handles:
            return
        self.prompt_tokens.inc(t.prompt_tokens)
        self.generation_tokens.inc(t.output_tokens)
        for handle, reason in zip(t.handles, t.finish_reasons()):
            self.finished.labels(reason).inc()
            if handle.first_token_at is not None:
                self.ttft.observe(handle.first_token_at - t.start)
            tpot = handle.time_per_output_token()
            if tpot is not None:
                self.tpot.observe(tpot)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """Engine state, read when scraped."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def describe(self) -> list[Metric]:
        return []  # nothing to read before the engine loads; the names appear at the first scrape

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        s = engine.stats()
        model = engine.info.id if engine.ready else ""
        info = GaugeMetricFamily("ktserve_info", "What is serving", labels=["version", "engine", "model"])
        info.add_metric([__version__, engine.name, model], 1)
        yield info
        yield GaugeMetricFamily("ktserve_requests_running", "Engine requests (one per choice) generating now",
                                value=s.running)
        yield GaugeMetricFamily("ktserve_requests_waiting", "Engine requests (one per choice) queued to start",
                                value=s.waiting)
        yield GaugeMetricFamily("ktserve_kv_cache_used_tokens", "KV cache positions in use", value=s.kv_used_tokens)
        yield GaugeMetricFamily("ktserve_kv_cache_total_tokens", "KV cache capacity in positions (0: unbounded)",
                                value=s.kv_total_tokens)
        if s.kv_total_tokens:
            yield GaugeMetricFamily("ktserve_kv_cache_usage_ratio", "Share of the KV cache in use",
                                    value=s.kv_used_tokens / s.kv_total_tokens)
        yield CounterMetricFamily("ktserve_preemptions", "Running requests whose KV cache was freed to make room "
                                  "when the cache filled; each recomputes it when it resumes", value=s.preemptions)
        yield CounterMetricFamily("ktserve_engine_steps", "Model steps run", value=s.steps)
        yield CounterMetricFamily("ktserve_engine_step_seconds", "Seconds the engine spent in model steps",
                                  value=s.times.step)
        yield CounterMetricFamily("ktserve_engine_expert_wait_seconds",
                                  "Seconds model steps stalled waiting on CPU experts (ktransformers engine)",
                                  value=s.times.expert_wait)
        yield CounterMetricFamily("ktserve_engine_forward_seconds", "Seconds of model steps in the model's forward "
                                  "(the rest: sampling, detokenizing, delivery)", value=s.times.forward)
        yield CounterMetricFamily("ktserve_engine_expert_seconds", "Seconds from submitting CPU experts to "
                                  "their results being ready, summed over layers (ktransformers engine)",
                                  value=s.times.expert)
        yield CounterMetricFamily("ktserve_engine_gpu_seconds", "GPU stream seconds of model steps, less the "
                                  "stalls on CPU experts (ktransformers engine on a GPU)", value=s.times.gpu)
        yield CounterMetricFamily("ktserve_prefix_cache_queried_tokens",
                                  "Prompt tokens of engine requests (one per choice) that started",
                                  value=s.prompt_tokens)
        yield CounterMetricFamily("ktserve_prefix_cache_hit_tokens",
                                  "Of those, prompt tokens the prefix cache already held (not computed again)",
                                  value=s.cached_prompt_tokens)
        yield CounterMetricFamily("ktserve_streamed_expert_calls", "Layer expert calls of prompt chunks that computed "
                                  "experts on a GPU from streamed weights (kt_gpu_prefill_tokens)",
                                  value=s.streamed_expert_calls)
        yield CounterMetricFamily("ktserve_spec_decode_draft_tokens", "Draft tokens the model verified "
                                  "(speculative decoding)", value=s.draft_tokens)
        yield CounterMetricFamily("ktserve_spec_decode_accepted_tokens", "Of those, the ones it kept",
                                  value=s.accepted_draft_tokens)
        if s.draft_tokens:
            yield GaugeMetricFamily("ktserve_spec_decode_acceptance_ratio", "Share of draft tokens kept since start",
                                    value=s.accepted_draft_tokens / s.draft_tokens)
        yield GaugeMetricFamily("ktserve_spec_decode_paused", "1 while drafting is paused because drafted steps "
                                "gave fewer tokens a second than plain ones (speculative_adaptive), else 0",
                                value=int(s.draft_paused))
        yield CounterMetricFamily("ktserve_spec_decode_paused_steps", "Decode steps that ran without drafts while "
                                  "drafting was paused or plain steps were timed to compare against",
                                  value=s.draft_paused_steps)
        yield CounterMetricFamily("ktserve_streamed_expert_bytes", "Bytes of expert weights those calls copied to the "
                                  "GPU", value=s.streamed_expert_bytes)
