"""A 2,048-token prompt's logprobs from logits on the GPU: e39ef4b's way (the rows copied to the host, then each
row's log_softmax and entry there, one torch thread) against Sampler.prompt_entries on the GPU. JSON lines."""
import importlib.util
from pathlib import Path
import json
import statistics
import time

import torch

torch.set_num_threads(1)
spec = importlib.util.spec_from_file_location("old_sampler", Path(__file__).with_name("old_sampler.py"))
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
from engines.runtime.sampler import Sampler  # noqa: E402


class Pieces:
    @staticmethod
    def convert_ids_to_tokens(token_id):
        return f"t{token_id}"


n, vocab = 2048, 102400
logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)).cuda()
targets = torch.randint(vocab, (n,)).tolist()
before, now = old.Sampler(Pieces(), (1,)), Sampler(Pieces(), (1,))


def previous(top):
    rows = logits.cpu()
    return [before.logprob_entry(torch.log_softmax(rows[i], dim=-1), targets[i], top) for i in range(n)]


def current(top):
    return now.prompt_entries(logits, targets, top)


for top in (0, 1, 5):
    for name, fn in (("before", previous), ("now", current)):
        fn(top)
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn(top)
            times.append(time.perf_counter() - t)
        print(json.dumps({"prompt_positions": n, "top": top, "code": name, "ms": round(statistics.median(times) * 1e3, 2)}))
