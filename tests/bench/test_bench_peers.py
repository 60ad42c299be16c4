"""bench.peers sets ktserve's figures of a run beside ik_llama.cpp's and llama.cpp's (their llama-bench output and
streaming rounds, faked here: the engines themselves are built and run on the GPU machine), trims the peers'
CUDA kernels to the GGUF types used, and cuts the checkpoint's tokenizer to the model's vocabulary for the
GGUF converter."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

# ik_llama.cpp's llama-bench -o json (one array), llama.cpp's -o jsonl (one object a line): abridged
IK_JSON = """[
  {"build_commit": "abc", "n_prompt": 512, "n_gen": 128, "n_threads": 14, "test": "tg128@pp512",
   "avg_ts": 51.5, "stddev_ts": 0.2, "samples_ts": [51.4, 51.6]},
  {"build_commit": "abc", "n_prompt": 2048, "n_gen": 0, "avg_ts": 900.0, "samples_ts": [900.0]},
  {"build_commit": "abc", "n_prompt": 8192, "n_gen": 0, "avg_ts": 800.0, "samples_ts": [800.0]}
]"""
ML_JSONL = ('{"n_prompt": 0, "n_gen": 128, "n_depth": 512, "avg_ts": 40.0, "samples_ts": [40.0]}\n'
            '{"n_prompt": 2048, "n_gen": 0, "n_depth": 0, "avg_ts": 1200.0, "samples_ts": [1200.0]}\n')


def _peer(name: str, text: str, clients: dict[int, float]) -> dict:
    from bench.lib.peer_runs import _slim, bench_records

    memory = {"gpu_peak": {"value": 3.0, "unit": "GB"}, "host_rss_peak": {"value": 20.0, "unit": "GB"}}
    return {"name": name, "version": "v", "bits": "Q8_0", "runs": [
        {"label": "decode", "records": [_slim(r) for r in bench_records(text)], "memory": memory}],
        "servers": [{"slots": n, "round": {"output_throughput": {"value": rate, "unit": "tok/s"}}} for n, rate in
                    clients.items()]}


def _bench_with(results: dict) -> SimpleNamespace:
    return SimpleNamespace(results=SimpleNamespace(data=results))


def test_peers_table_sets_ktserve_against_the_best_peer_of_each_figure():
    from bench.peers import engine_entries, peers_lines, ratios

    results = {"meta": {"primary": "AMXINT8"},
               "kt": {"AMXINT8": {"decode": {"decode_throughput": {"value": 61.8, "unit": "tok/s"}},
                                  "memory": {"gpu_used_nvidia_smi": {"value": 4.0, "unit": "GB"}}}},
               "ttft": {"points": [{"prompt_tokens": 2048, "prefill_throughput": {"value": 3600.0, "unit": "tok/s"}},
                                   {"prompt_tokens": 8192, "prefill_throughput": {"value": 4000.0, "unit": "tok/s"}}]},
               "http": {"rounds": [{"concurrency": 4, "output_throughput": {"value": 60.0, "unit": "tok/s"}},
                                   {"concurrency": 16, "output_throughput": {"value": 300.0, "unit": "tok/s"}}]}}
    measured = {("ik_llama.cpp", "Q8_0"): _peer("ik_llama.cpp", IK_JSON, {16: 100.0}),
                ("llama.cpp", "Q8_0"): _peer("llama.cpp", ML_JSONL, {16: 150.0, 32: 200.0})}
    engines = engine_entries(_bench_with(results), measured)
    assert [(e["name"], e["bits"]) for e in engines] == [("ktserve", "AMXINT8"), ("ik_llama.cpp", "Q8_0"),
                                                         ("llama.cpp", "Q8_0")]
    ik = engines[1]["figures"]
    assert ik["decode"]["value"] == 51.5 and ik["prefill_8192"]["value"] == 800.0 and "prefill_512" not in ik
    assert engines[2]["figures"]["decode"]["value"] == 40.0  # llama.cpp's tg128 at depth 512
    r = ratios(engines, "AMXINT8")
    assert r["decode"]["value"] == pytest.approx(61.8 / 51.5) and r["decode"]["best_peer"] == "ik_llama.cpp"
    assert r["prefill_2048"]["value"] == pytest.approx(3.0) and r["prefill_2048"]["best_peer"] == "llama.cpp"
    assert r["prefill_8192"]["value"] == pytest.approx(5.0)
    assert r["clients_16"]["value"] == pytest.approx(2.0)
    assert r["clients_32"]["value"] is None  # ktserve's run had no 32-client round
    lines = peers_lines({"threads": 14, "engines": engines, "ratios": r})
    assert any(line.startswith("ik_llama.cpp") and "51.5" in line and "800" in line for line in lines)
    assert any("decode 1.20 (ik_llama.cpp)" in line and "prefill_2048 3.00 (llama.cpp)" in line for line in lines)


def test_trimmed_build_drops_other_types_kernels_and_aborts_their_calls(tmp_path):
    from bench.lib.peer_build import trim_cuda

    cuda = tmp_path / "ggml" / "src" / "ggml-cuda"
    (cuda / "template-instances").mkdir(parents=True)
    for name in ("mmq-instance-q8_0.cu", "mmq-instance-iq2_k.cu", "mmq-instance-iq2_k_id.cu",
                 "mmvq-instance-q4_K.cu", "mmvq-instance-iq1_bn.cu", "fattn-vec-instance-hs128-f16-f16.cu"):
        (cuda / "template-instances" / name).write_text("// instance\n")
    (cuda / "mmq.cu").write_text(
        "switch (t) {\n case GGML_TYPE_Q8_0: mul_mat_q_case<GGML_TYPE_Q8_0>(ctx, args, stream); break;\n"
        " case GGML_TYPE_IQ2_K: mul_mat_q_case<GGML_TYPE_IQ2_K>(ctx, args, stream); break;\n"
        " case GGML_TYPE_MXFP4: mul_mat_q_case<GGML_TYPE_MXFP4, GGML_PREC_Q4>(ctx, args, stream); break;\n}\n")
    (cuda / "mmvq.cu").write_text("mul_mat_vec_q4_K_q8_1_cuda(args, stream);\nmul_mat_vec_iq1_bn_q8_1_cuda(args, stream);\n")
    report = trim_cuda(tmp_path, keep=("q8_0", "q4_k"))
    left = sorted(p.name for p in (cuda / "template-instances").iterdir())
    assert left == ["fattn-vec-instance-hs128-f16-f16.cu", "mmq-instance-q8_0.cu", "mmvq-instance-q4_K.cu"]
    mmq, mmvq = (cuda / "mmq.cu").read_text(), (cuda / "mmvq.cu").read_text()
    assert "mul_mat_q_case<GGML_TYPE_Q8_0>" in mmq and "mul_mat_q_case<GGML_TYPE_IQ2_K>" not in mmq
    assert 'GGML_ABORT("IQ2_K: type trimmed' in mmq and "GGML_TYPE_MXFP4, GGML_PREC_Q4>(" not in mmq
    assert "mul_mat_vec_q4_K_q8_1_cuda" in mmvq and 'GGML_ABORT("iq1_bn: type trimmed' in mmvq
    assert report["instance_files_removed"] == 3 and report["calls_aborted"] == 3


def test_gguf_conversion_folder_cuts_the_tokenizer_to_the_models_vocabulary(tmp_path):
    from bench.peer_gguf import conversion_folder

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 4}))
    (model / "model-00001-of-00001.safetensors").write_bytes(b"")
    (model / "tokenizer_config.json").write_text(json.dumps({"add_sep_token": False, "bos_token": "<s>"}))
    vocab = {"<s>": 0, "a": 1, "b": 2, "ab": 3, "c": 4, "abc": 5}
    (model / "tokenizer.json").write_text(json.dumps({
        "model": {"type": "BPE", "vocab": vocab, "merges": ["a b", "ab c"]},
        "added_tokens": [{"id": 0, "content": "<s>"}, {"id": 9, "content": "<extra>"}]}))
    folder = conversion_folder(model, tmp_path / "convert")
    tok = json.loads((folder / "tokenizer.json").read_text())
    assert tok["model"]["vocab"] == {"<s>": 0, "a": 1, "b": 2, "ab": 3}
    assert tok["model"]["merges"] == ["a b"] and [t["id"] for t in tok["added_tokens"]] == [0]
    assert "add_sep_token" not in json.loads((folder / "tokenizer_config.json").read_text())
    assert (folder / "model-00001-of-00001.safetensors").resolve() == (model / "model-00001-of-00001.safetensors")
    assert Path(folder / "config.json").is_symlink()


def test_peer_sources_are_found_packed_or_as_downloaded_for_the_engines_asked(tmp_path):
    from bench.lib.peer_build import find_archives
    from bench.peers import engine_list

    (tmp_path / "ik_llama.cpp.tar.xz").write_bytes(b"")
    (tmp_path / "llama_cpp_python-0.3.36.tar.gz").write_bytes(b"")
    assert find_archives(tmp_path) == {"llama.cpp": tmp_path / "llama_cpp_python-0.3.36.tar.gz",
                                       "ik_llama.cpp": tmp_path / "ik_llama.cpp.tar.xz"}
    assert find_archives(tmp_path, engine_list("ik_llama.cpp")) == {"ik_llama.cpp": tmp_path / "ik_llama.cpp.tar.xz"}
    with pytest.raises(argparse.ArgumentTypeError, match="unknown peer.*vllm"):
        engine_list("llama.cpp,vllm")


def _sdist(path: Path, files: dict[str, str]) -> Path:
    """A PyPI-like source archive of ik-llama-cpp-python holding `files` under its vendored tree."""
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(f"ik_llama_cpp_python-0.1.5/vendor/ik_llama.cpp/{name}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return path


_RUNS_BUILD_INFO = 'COMMAND ${CMAKE_COMMAND} -P "${CMAKE_CURRENT_SOURCE_DIR}/cmake/build-info-gen-cpp.cmake"\n'


def test_packed_ik_tree_has_the_build_info_script_its_cmake_runs_though_the_archive_lacks_it(tmp_path):
    import tarfile

    from bench.lib.peer_build import pack

    sdist = _sdist(tmp_path / "ik_llama_cpp_python-0.1.5.tar.gz", {
        "CMakeLists.txt": "include(${CMAKE_CURRENT_SOURCE_DIR}/cmake/build-info.cmake)\n",
        "cmake/build-info.cmake": "set(BUILD_NUMBER 0)\n", "common/CMakeLists.txt": _RUNS_BUILD_INFO,
        "common/build-info.cpp.in": "int LLAMA_BUILD_NUMBER = @BUILD_NUMBER@;\n"})
    with tarfile.open(pack(sdist, tmp_path / "packed")) as tar:
        script = tar.extractfile("ik_llama.cpp/common/cmake/build-info-gen-cpp.cmake").read().decode()
        assert "ik_llama.cpp/cmake/build-info.cmake" in tar.getnames()
    assert "include(${CMAKE_CURRENT_SOURCE_DIR}/cmake/build-info.cmake)" in script
    assert "configure_file(${TEMPLATE_FILE} ${OUTPUT_FILE})" in script and "common/build-info.cpp.in" in script


def test_packing_stops_naming_a_script_the_cmake_files_run_that_the_archive_lacks(tmp_path):
    from bench.lib.peer_build import pack

    sdist = _sdist(tmp_path / "ik_llama_cpp_python-0.1.5.tar.gz", {
        "CMakeLists.txt": "", "common/CMakeLists.txt": _RUNS_BUILD_INFO,
        "ggml/src/CMakeLists.txt": "include(${CMAKE_CURRENT_SOURCE_DIR}/cmake/gone.cmake)\n"})
    with pytest.raises(ValueError, match=r"ggml/src/cmake/gone\.cmake, which the archive lacks"):
        pack(sdist, tmp_path / "packed")
    assert not (tmp_path / "packed" / "ik_llama.cpp.tar.xz").exists()


def _row(name: str, bits: str, **values: float) -> dict:
    return {"name": name, "bits": bits, "figures": {k: {"value": v, "unit": "tok/s"} for k, v in values.items()}}


def test_ktserve_on_the_peers_gguf_file_gets_its_own_row_measured_like_its_safetensors_run(tmp_path):
    """ktserve serves the GGUF file itself (tiny shape, on this CPU): its row has a decode rate, a prefill rate per
    ttft prompt and the 16- and 32-client aggregates, and its ratio to the best peer at those bits."""
    from tests.helpers import require_kt_kernel

    require_kt_kernel()
    pytest.importorskip("openai")
    import time

    from bench.lib.checkpoint import build_checkpoint
    from bench.peer_gguf import conversion_folder
    from bench.peers import engine_entries, measure_ktserve_gguf, peers_lines, with_ratios
    from bench.run import Bench, parse_args
    from bench.lib.shapes import SHAPES
    from engines.checkpoints.gguf.writer import write_gguf

    shape = SHAPES["tiny"]
    model = tmp_path / "tiny"
    build_checkpoint(model, shape.config, shard_bytes=shape.plan.shard_bytes)
    # the folder llama.cpp's converter reads in the benchmark (tokenizer cut to the vocabulary), written by ours
    folder = conversion_folder(model, tmp_path / "convert")
    (gguf,) = write_gguf(folder, tmp_path / "model-Q8_0.gguf", dict.fromkeys(("experts", "attention", "other"), "Q8_0"))
    bench = Bench(parse_args(["--shape", "tiny", "--quick", "--only", "peers", "--model-dir", str(model),
                              "--out", str(tmp_path / "out"), "--threads", "1"]), time.perf_counter())
    bench.vocab = 1000
    row = measure_ktserve_gguf(bench, gguf, time.perf_counter() + 120, full=True)
    assert "failed" not in row, row.get("traceback")
    peer = {("llama.cpp", "Q8_0"): {"name": "llama.cpp", "version": "v", "bits": "Q8_0", "runs": [{"label": "decode",
            "records": [{"n_prompt": 0, "n_gen": 128, "n_depth": 512, "avg_ts": 1.0}]}], "servers": [
            {"slots": 16, "round": {"output_throughput": {"value": 1.0, "unit": "tok/s"}}}]}}
    engines = engine_entries(bench, peer, {"Q8_0": row})
    assert [(e["name"], e["bits"]) for e in engines] == [("ktserve (GGUF Q8_0)", "Q8_0"), ("llama.cpp", "Q8_0")]
    ours = engines[0]["figures"]
    assert engines[0]["gguf"] == str(gguf) and engines[0]["experts_method"]
    for key in ("decode", *(f"prefill_{n}" for n in bench.plan.ttft_prompts), "clients_16", "clients_32"):
        assert ours[key]["value"] > 0, key
    r = with_ratios(engines, "AMXINT8")["ratios_gguf_by_bits"]["Q8_0"]
    assert r["decode"]["value"] == pytest.approx(ours["decode"]["value"]) and r["decode"]["best_peer"] == "llama.cpp"
    assert any(line.startswith("ktserve (GGUF Q8_0)") for line in peers_lines({"engines": engines}))


def test_peers_table_merges_the_calls_at_8_and_4_bits_into_one_with_ratios_per_bits(tmp_path, capsys):
    from bench.peers import main

    eight = {"threads": 14, "quants": ["Q8_0"], "engines": [
        _row("ktserve", "AMXINT8", decode=40.0, clients_16=100.0), _row("ktserve (GGUF Q8_0)", "Q8_0", decode=30.0),
        _row("llama.cpp", "Q8_0", decode=36.0, clients_16=50.0), _row("ik_llama.cpp", "Q8_0", decode=20.0)]}
    four = {"threads": 14, "quants": ["Q4_0"], "engines": [
        _row("ktserve", "AMXINT4", decode=60.0), _row("ik_llama.cpp", "Q4_0", decode=50.0)]}
    files = []
    for name, section in (("b", eight), ("c", four)):
        (tmp_path / name).mkdir()
        files.append(tmp_path / name / "bench.json")
        files[-1].write_text(json.dumps({"peers": section}))
    assert main(["table", *map(str, files), "--out", str(tmp_path / "peers.json")]) == 0
    merged = json.loads((tmp_path / "peers.json").read_text())["peers"]
    assert [(e["name"], e["bits"]) for e in merged["engines"]] == [
        ("ktserve", "AMXINT8"), ("ktserve (GGUF Q8_0)", "Q8_0"), ("llama.cpp", "Q8_0"), ("ik_llama.cpp", "Q8_0"),
        ("ktserve", "AMXINT4"), ("ik_llama.cpp", "Q4_0")]
    by_bits = merged["ratios_by_bits"]
    assert by_bits["Q8_0"]["decode"]["value"] == pytest.approx(40 / 36, rel=1e-4)
    assert by_bits["Q8_0"]["decode"]["best_peer"] == "llama.cpp"
    assert by_bits["Q8_0"]["clients_16"]["value"] == pytest.approx(2.0)
    assert by_bits["Q4_0"]["decode"]["value"] == pytest.approx(60 / 50)
    assert merged["ratios_gguf_by_bits"]["Q8_0"]["decode"]["value"] == pytest.approx(30 / 36, rel=1e-4)
    printed = capsys.readouterr().out
    assert "ktserve / best peer at Q4_0: decode 1.20 (ik_llama.cpp)" in printed
    assert "ktserve on the GGUF / best peer at Q8_0: decode 0.83 (llama.cpp)" in printed


def test_ktserve_on_a_gguf_file_is_skipped_with_the_reason_when_the_phase_has_no_time_left_for_its_load():
    import time

    from bench.peers import GGUF_ROW_MIN_SECONDS, engine_entries, measure_ktserve_gguf, peers_lines

    from bench.lib.shapes import SHAPES

    bench = SimpleNamespace(plan=SHAPES["v2-lite"].plan, results=SimpleNamespace(data={}))
    row = measure_ktserve_gguf(bench, Path("model-Q4_0.gguf"), time.perf_counter() + GGUF_ROW_MIN_SECONDS / 2,
                               full=True)
    assert row["skipped"].endswith(f"left, {GGUF_ROW_MIN_SECONDS}s needed to start")
    (entry,) = engine_entries(bench, {}, {"Q4_0": row})
    assert entry["figures"]["decode"]["value"] is None
    assert any(line.startswith("ktserve (GGUF Q4_0) Q4_0: skipped: ") for line in peers_lines({"engines": [entry]}))


def test_ktserve_cpu_prefill_row_is_in_the_printed_and_merged_tables_with_its_ratios(tmp_path, capsys):
    """A run whose row with prompts' experts on the CPU measured figures shows that row, with its options, in the
    summary's table and in `bench.peers table`, and its ratios to the best peer."""
    from bench.peers import CPU_PREFILL, CPU_PREFILL_ROW_NAME, engine_entries, main, peers_lines, with_ratios

    def rate(value: float) -> dict:
        return {"value": value, "unit": "tok/s"}

    cpu_row = {"model": "m", "kt_method": "AMXINT8", "options": dict(CPU_PREFILL),
                "engine_details": {"experts_method": "AMXINT8", "gpu_prefill_tokens": "0"},
                "decode": {"decode_throughput": rate(40.0)},
                "ttft": [{"prompt_tokens": n, "prefill_throughput": rate(r)}
                         for n, r in ((2048, 9000.0), (8192, 12000.0))],
                "http": {"rounds": [{"concurrency": 16, "output_throughput": rate(110.0)}]}}
    peer = {("ik_llama.cpp", "Q8_0"): _peer("ik_llama.cpp", IK_JSON, {16: 50.0})}
    engines = engine_entries(_bench_with({}), peer, cpu_prefill={"AMXINT8": cpu_row})
    assert [(e["name"], e["bits"]) for e in engines] == [(CPU_PREFILL_ROW_NAME, "AMXINT8"), ("ik_llama.cpp", "Q8_0")]
    assert engines[0]["options"] == {"kt_gpu_prefill_tokens": 0, "chunk_size": 2048}
    section = {"threads": 14, "engines": engines, **with_ratios(engines, "AMXINT8")}
    r = section["ratios_cpu_prefill_by_bits"]["Q8_0"]
    assert r["prefill_8192"]["value"] == pytest.approx(12000 / 800) and r["clients_16"]["value"] == pytest.approx(2.2)
    printed = "\n".join(peers_lines(section))
    assert any(line.startswith(CPU_PREFILL_ROW_NAME) and "12000" in line for line in printed.splitlines())
    assert "ktserve, prompts on the CPU / best peer at Q8_0: decode 0.78 (ik_llama.cpp)" in printed
    (tmp_path / "bench.json").write_text(json.dumps({"peers": section}))
    assert main(["table", str(tmp_path / "bench.json")]) == 0
    merged = capsys.readouterr().out
    assert any(line.startswith(CPU_PREFILL_ROW_NAME) and "12000" in line for line in merged.splitlines())
    assert "ktserve, prompts on the CPU / best peer at Q8_0: decode 0.78" in merged


def test_ktserve_cpu_prefill_row_says_it_was_skipped_without_a_gpu(monkeypatch):
    import time

    import torch

    from bench.peers import CPU_PREFILL_ROW_NAME, engine_entries, measure_ktserve_cpu_prefill, peers_lines

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bench = SimpleNamespace(model_dir=Path("v2-lite"), results=SimpleNamespace(data={}))
    row = measure_ktserve_cpu_prefill(bench, "AMXINT4", time.perf_counter() + 300, clients=True)
    (entry,) = engine_entries(bench, {}, cpu_prefill={"AMXINT4": row})
    assert entry["options"]["kt_gpu_prefill_tokens"] == 0 and entry["figures"]["decode"]["value"] is None
    assert any(line.startswith(f"{CPU_PREFILL_ROW_NAME} AMXINT4: skipped: no GPU")
               for line in peers_lines({"engines": [entry]}))


class _StallingServer:
    """An OpenAI-style completions server on 127.0.0.1 that streams `tokens` tokens of each request asking for more,
    then stops streaming (holding the connection until the test ends, at most 30 s); shorter requests finish."""

    def __init__(self, tokens: int):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        release = self.release = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args):
                pass

            def do_GET(self):
                self.send_response(404)
                self.end_headers()

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                asked = int(body["max_tokens"])
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for _ in range(min(asked, tokens)):
                    chunk = {"id": "c", "object": "text_completion", "created": 0, "model": "peer",
                             "choices": [{"index": 0, "text": "a", "finish_reason": None, "logprobs": None}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                if asked > tokens:
                    release.wait(30)
                    return
                self.wfile.write(b"data: [DONE]\n\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def test_a_round_cut_at_its_time_limit_gives_the_tokens_streamed_by_then_as_a_marked_partial_figure():
    """A peer's server that stops streaming: the round (bounded at 6 s) reports the 4 x 3 tokens streamed by its
    limit over the time to it, flagged partial; the table shows it marked and no ratio uses it."""
    from bench.lib.peer_runs import run_clients
    from bench.peers import peer_figures, peers_lines, ratios

    with _StallingServer(tokens=3) as server:
        rnd = run_clients(server.url, 4, 8, 16, 1000, timeout=6)
    assert rnd["timed_out"] and rnd["completed"] == 0 and rnd["output_throughput"]["value"] is None
    partial = rnd["output_throughput_partial"]
    assert partial["partial"] and partial["completed"] == 0 and partial["requests"] == 4
    assert partial["output_tokens"] == 12 and partial["value"] == pytest.approx(12 / partial["elapsed"], rel=1e-3)
    entry = {"name": "llama.cpp", "version": "v", "bits": "Q8_0", "runs": [], "servers": [{"slots": 32, "round": rnd}]}
    engines = [_row("ktserve", "AMXINT8", clients_32=150.0),
               {**entry, "figures": peer_figures(entry)}]
    assert engines[1]["figures"]["clients_32"]["partial"]
    assert ratios(engines, "AMXINT8")["clients_32"]["value"] is None
    lines = peers_lines({"engines": engines})
    row = next(line for line in lines if line.startswith("llama.cpp"))
    assert f"~{partial['value']:.1f}" in row
    assert any(line.startswith("~ the round hit its time limit") and "llama.cpp Q8_0 32 clients 0/4" in line
               for line in lines)
    from bench.summary import summary_lines

    assert any(line.startswith("HTTP   4 clients") and f"(timed out: ~{partial['value']:.1f} tok/s streamed by then, "
               "0 of 4 requests done)" in line for line in summary_lines({"meta": {}, "http": {"rounds": [rnd]}}))


def test_peers_phase_estimate_counts_the_builds_left_and_the_ktserve_rows_asked_for(tmp_path):
    from bench.lib.peer_build import ENGINES, binaries
    from bench.peers import phase_estimate
    from bench.lib.shapes import PEERS_PARTS, SHAPES

    def estimate(rows: tuple[str, ...], methods: tuple[str, ...]) -> float:
        args = SimpleNamespace(peers_engines=("llama.cpp", "ik_llama.cpp"), peers_ktserve=rows, peers_work=tmp_path,
                               methods=methods)
        return phase_estimate(SimpleNamespace(plan=SHAPES["v2-lite"].plan, args=args, primary="AMXINT8"))

    unbuilt = estimate(("cpu-prefill",), ("AMXINT8",))
    for name in ("llama.cpp", "ik_llama.cpp"):
        binaries(tmp_path, name).mkdir(parents=True)
        for target in ENGINES[name].targets:
            (binaries(tmp_path, name) / target).write_text("")
    p = PEERS_PARTS
    one_bits = 2 * (p["bench"] + p["server_16"] + p["server_32"]) + p["cpu_prefill"]
    assert unbuilt == p["build"] + one_bits
    assert estimate(("cpu-prefill",), ("AMXINT8",)) == one_bits
    assert estimate(("cpu-prefill", "gguf"), ("AMXINT8",)) == one_bits + p["gguf"]
    assert estimate(("cpu-prefill",), ("AMXINT8", "AMXINT4")) == one_bits + 2 * p["bench_decode"] + \
        p["cpu_prefill_no_clients"]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_ktserve_streams_prompts_by_default_and_its_cpu_prefill_row_measures_each_figure_on_a_gpu(tmp_path):
    """On the GPU machine (`pytest -m gpu`): the run's own engine streams prompts' experts by default
    (gpu_prefill_tokens 128, chunks of 8,192), the CPU-prefill row's engine does not (chunks of 2,048), and the row
    has a decode rate, a prefill rate per ttft prompt and both client rounds."""
    import time

    from tests.helpers import require_kt_kernel

    require_kt_kernel()
    from bench.lib.checkpoint import build_checkpoint
    from bench.peers import CPU_PREFILL_ROW_NAME, engine_entries, measure_ktserve_cpu_prefill
    from bench.run import Bench, parse_args
    from bench.lib.shapes import SHAPES

    shape = SHAPES["tiny"]
    build_checkpoint(tmp_path / "tiny", shape.config, shard_bytes=shape.plan.shard_bytes)
    bench = Bench(parse_args(["--shape", "tiny", "--quick", "--only", "peers", "--model-dir", str(tmp_path / "tiny"),
                              "--out", str(tmp_path / "out")]), time.perf_counter())
    bench.vocab = 1000
    own = bench.kt_engine("AMXINT8")
    assert (own.engine.info.details["gpu_prefill_tokens"], own.engine.config.chunk_size) == ("128", 8192)
    bench.close_engines()
    row = measure_ktserve_cpu_prefill(bench, "AMXINT8", time.perf_counter() + 200, clients=True)
    assert "failed" not in row, row.get("traceback")
    assert row["engine_details"]["gpu_prefill_tokens"] == ("0: every routed expert of a prompt on the CPU "
                                                           "(kt_gpu_prefill_tokens=0)")
    (entry,) = engine_entries(bench, {}, cpu_prefill={"AMXINT8": row})
    assert entry["name"] == CPU_PREFILL_ROW_NAME
    for key in ("decode", *(f"prefill_{n}" for n in bench.plan.ttft_prompts), "clients_16", "clients_32"):
        assert entry["figures"][key]["value"] > 0, key


def test_merged_calls_that_reused_the_same_builds_say_so_once():
    from bench.peers import peers_lines

    reused = {"llama.cpp": {"reused": True}, "ik_llama.cpp": {"reused": True}}
    section = {"engines": [], "build": reused, "merged_from": [{"build": reused}, {"build": reused}]}
    builds = [line for line in peers_lines(section) if line.startswith("build ")]
    assert builds == ["build llama.cpp: reused", "build ik_llama.cpp: reused"]
